"""The asyncio producer client (``redis.asyncio``); same semantics as ``worker.client``.

::

    async with AsyncScoringClient("redis://127.0.0.1:6379/0") as client:
        scores = await client.score(rollouts, timeout=60)
        async for result in client.score_many(jobs, max_in_flight=32, ordered=False):
            ...

A reader task owns the reply stream; results for any job id are buffered until awaited. The
logic is the shared core's (``worker.client.core``); this module performs its effects with
``await``. No torch import.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import redis

from worker.client.base import ClientBase
from worker.client.core import new_job_id
from worker.client.effects import END, Block, Command, Delivered, DurableAdd, Effect, Pause, Steps
from worker.client.errors import ClientClosed, JobFailed, ScoringTimeout, client_checks
from worker.client.inputs import JobSpec, group_seqs, student_seqs, teacher_settings
from worker.client.results import JobHandle, ScoreResult, SeqScore, job_id_of, unwrap
from worker.client.window import ScoreWindow
from worker.client.workers import QueueState
from worker.config import DEFAULT_REDIS_URL
from worker.connections import connect_async, xadd_wait_async
from worker.protocol import Result
from worker.request import ScoreOptions

log = logging.getLogger(__name__)

T = TypeVar("T")


class AsyncScoringClient(ClientBase):
    """Asyncio producer client. Use ``async with`` or ``await client.close()``.

    Same constructor arguments as ``ScoringClient``. Create it inside the running loop.
    """

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, *args: Any, **kwargs: Any) -> None:
        super().__init__(redis_url, *args, **kwargs)
        self.redis: Any = connect_async(self.settings)
        self._cond: asyncio.Condition | None = None
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncScoringClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- effects

    async def _run(self, steps: Steps[T]) -> T:
        """Perform the effects of one core operation (stepping it never awaits, so the core is
        never seen half-changed by another task)."""
        reply: Any = None
        error: BaseException | None = None
        while True:
            try:
                effect = steps.throw(error) if error is not None else steps.send(reply)
            except StopIteration as stop:
                return stop.value
            reply, error = None, None
            try:
                reply = await self._perform(effect)
            except BaseException as exc:  # cancellation too: score forgets its job
                error = exc

    async def _perform(self, effect: Effect) -> Any:
        core = self._core
        if isinstance(effect, Command):
            return await getattr(self.redis, effect.name)(*effect.args, **effect.kwargs)
        if isinstance(effect, DurableAdd):
            return await xadd_wait_async(
                self.redis, effect.stream, effect.fields, effect.replicas, effect.timeout_ms
            )
        if isinstance(effect, Block):
            seen = effect.seen
            cond = self._condition()
            async with cond:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        cond.wait_for(lambda: core.arrivals != seen or core.closed),
                        effect.timeout_s,
                    )
            return None
        if isinstance(effect, Delivered):
            cond = self._condition()
            async with cond:
                cond.notify_all()
            return None
        if isinstance(effect, Pause):
            await asyncio.sleep(effect.seconds)
            return None
        source = effect.source  # NextItem
        if isinstance(source, AsyncIterator):
            return await anext(source, END)
        return next(source, END)

    # -- lifecycle

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:  # made on first use, inside the running loop
            self._cond = asyncio.Condition()
        return self._cond

    def _ensure_reader(self) -> None:
        if self._core.closed:
            raise ClientClosed("the client is closed")
        if self._reader is None:
            self._reader = asyncio.create_task(
                self._run(self._core.read_replies()), name=f"reply-{self.client_id}"
            )

    async def close(self) -> None:
        """Stop the reader task and delete the reply stream (TTL when jobs are outstanding or
        were forgotten unanswered)."""
        if self._core.closed:
            return
        self._core.closed = True
        try:
            if self._reader is not None:
                self._reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._reader
            await self._run(self._core.close_reply_stream())
        except redis.RedisError as exc:
            log.warning("could not clean up reply stream %s: %s", self.reply_stream, exc)
        finally:
            if self._cond is not None:
                async with self._cond:
                    self._cond.notify_all()
            await self.redis.aclose()

    # -- producing

    async def submit(
        self,
        seqs: Any,
        mode: str | None = None,
        temperature: float = 1.0,
        *,
        deadline_ms: int | None = None,
        expires_in_s: float | None = None,
        meta: Any = None,
        job_id: str | None = None,
        outputs: Any = None,
        topk: int | None = None,
        gather_ids: Any = None,
        sampling: Mapping[str, Any] | None = None,
        float16: bool = False,
        hidden_dtype: str | None = None,
        max_result_bytes: int | None = None,
        adapter: str | None = None,
        version: str | None = None,
        step: Mapping[str, Any] | None = None,
        options: ScoreOptions | None = None,
        prefix: Any = None,
        images: Any = None,
        processor: Mapping[str, int] | None = None,
    ) -> JobHandle:
        """Enqueue one job (see ``ScoringClient.submit``, teacher outputs too)."""
        self._ensure_reader()
        job_id = job_id or new_job_id()
        request = teacher_settings(
            outputs, topk, gather_ids, sampling, float16, hidden_dtype, max_result_bytes
        )
        job = self._core.prepare(
            seqs, mode, temperature, deadline_ms, expires_in_s, meta, job_id, outputs=request,
            adapter=adapter, version=version, step=step, options=options, prefix=prefix,
            images=images, processor=processor,
        )  # fmt: skip
        return await self._run(self._core.submit(job))

    async def raw_result(
        self, handle_or_id: JobHandle | str, timeout: float | None = None
    ) -> Result:
        """Wait for a job's wire ``Result`` (ok or error) without raising on error results."""
        self._ensure_reader()
        return await self._run(self._core.wait_result(job_id_of(handle_or_id), timeout))

    async def result(
        self, handle_or_id: JobHandle | str, timeout: float | None = None
    ) -> ScoreResult:
        """Wait for a job's result; raises ``JobFailed`` subclasses / ``ScoringTimeout``. After a
        timeout the job is still tracked (wait again, or ``forget`` it)."""
        return unwrap(await self.raw_result(handle_or_id, timeout))

    async def live_workers(self, refresh: bool = False) -> int | None:
        """How many workers serve this queue now (see ``ScoringClient.live_workers``)."""
        return await self._run(self._core.workers.count(refresh))

    async def queue_state(self) -> QueueState:
        """Whether the queue is served now or was (see ``ScoringClient.queue_state``)."""
        return await self._run(self._core.workers.state())

    async def list_queues(self) -> list[str] | None:
        """The other queues the server holds (what ``UnknownQueueError`` names); None when the
        server will not list them."""
        return await self._run(self._core.workers.list_queues())

    async def timeout_error(self, job_id: str, waited_s: float) -> ScoringTimeout:
        """The ``ScoringTimeout`` of ``job_id`` after ``waited_s``, saying whether a worker
        serves the queue now (a ``Coalescer`` caller past its deadline)."""
        return await self._run(self._core.timeout(job_id, waited_s))

    def forget(self, handle_or_id: JobHandle | str) -> bool:
        """Give up on a job (see ``ScoringClient.forget``); a plain method, not a coroutine."""
        return self._core.forget(job_id_of(handle_or_id))

    async def score(
        self,
        seqs: Any,
        mode: str | None = None,
        temperature: float = 1.0,
        *,
        timeout: float | None = 300.0,
        meta: Any = None,
        expires_in_s: float | None = None,
        outputs: Any = None,
        topk: int | None = None,
        gather_ids: Any = None,
        sampling: Mapping[str, Any] | None = None,
        float16: bool = False,
        hidden_dtype: str | None = None,
        max_result_bytes: int | None = None,
        adapter: str | None = None,
        version: str | None = None,
        step: Mapping[str, Any] | None = None,
        options: ScoreOptions | None = None,
        prefix: Any = None,
        images: Any = None,
        processor: Mapping[str, int] | None = None,
    ) -> list[SeqScore]:
        """Submit one job and await its scores; forgotten on a timeout or cancellation."""
        self._ensure_reader()
        job_id = new_job_id()
        request = teacher_settings(
            outputs, topk, gather_ids, sampling, float16, hidden_dtype, max_result_bytes
        )
        job = self._core.prepare(
            seqs, mode, temperature, meta=meta, expires_in_s=expires_in_s, job_id=job_id,
            outputs=request, adapter=adapter, version=version, step=step, options=options,
            prefix=prefix, images=images, processor=processor,
        )  # fmt: skip
        return await self._run(self._core.score(job, timeout))

    async def score_groups(
        self,
        prompt: Any,
        completions: Sequence[Any],
        mode: str | None = None,
        temperature: float = 1.0,
        **kwargs: Any,
    ) -> list[SeqScore]:
        """Score a group: ``completions`` (token ids, or maps with ``tokens``) of one
        ``prompt`` (token ids), as one job that carries the prompt once (``prefix``); one
        ``SeqScore`` per completion, its log-probs over the completion's tokens (unless a map
        gives ``prompt_len`` or ``mask``, counted over prompt and completion). ``kwargs``:
        as ``score`` (``timeout``, ``outputs``, ``adapter``, ``images`` ...): the prompt's
        ``images`` are sent once and shown by every completion that names none of its own."""
        seqs = group_seqs(completions, kwargs.get("images"))  # the prompt's images, once
        return await self.score(seqs, mode, temperature, prefix=prompt, **kwargs)

    async def score_cross_tokenizer(
        self, students: Sequence[Mapping[str, Any]], temperature: float = 1.0, **kwargs: Any
    ) -> list[SeqScore]:
        """``ScoringClient.score_cross_tokenizer``: student views scored by a teacher with its
        own tokenizer (docs/distillation.md, *A teacher with its own tokenizer*)."""
        with client_checks("(score_cross_tokenizer)", kwargs.get("meta")):
            seqs = student_seqs(students, kwargs)
        return await self.score(seqs, "reference", temperature, **kwargs)

    async def score_many(
        self,
        jobs: Iterable[Any] | AsyncIterable[Any],
        *,
        max_in_flight: int = 64,
        ordered: bool = True,
        timeout: float | None = 300.0,
        mode: str | None = None,
        temperature: float = 1.0,
        raise_errors: bool = True,
        outputs: Any = None,
        topk: int | None = None,
        gather_ids: Any = None,
        sampling: Mapping[str, Any] | None = None,
        float16: bool | None = None,
        hidden_dtype: str | None = None,
        max_result_bytes: int | None = None,
        step: Mapping[str, Any] | None = None,
    ) -> AsyncIterator[ScoreResult | JobFailed]:
        """Async generator twin of ``ScoringClient.score_many`` (sync or async iterable in).

        ``timeout=None`` waits as long as it takes; jobs still in flight when it stops are
        forgotten. Teacher outputs and ``step`` for every job as in the sync twin."""
        defaults = JobSpec(None, outputs=outputs, topk=topk, gather_ids=gather_ids,
                           sampling=sampling, float16=float16, hidden_dtype=hidden_dtype,
                           max_result_bytes=max_result_bytes, step=step)  # fmt: skip
        window = ScoreWindow(
            self._core, jobs, max_in_flight, ordered, timeout, mode, temperature, raise_errors,
            defaults,
        )  # fmt: skip
        self._ensure_reader()
        try:
            while (out := await self._run(window.next())) is not None:
                yield out
        finally:
            window.close()
