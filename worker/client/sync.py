"""The synchronous producer client: the core's effects performed with ``redis-py`` calls, a reader
thread and a ``threading.Condition`` (see ``worker.client.core``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import redis

from worker.client.base import ClientBase
from worker.client.core import WAKE_FIELD, new_job_id
from worker.client.effects import END, Block, Command, Delivered, DurableAdd, Effect, Pause, Steps
from worker.client.errors import ClientClosed, JobFailed, client_checks
from worker.client.inputs import JobSpec, group_seqs, student_seqs, teacher_settings
from worker.client.results import JobHandle, ScoreResult, SeqScore, job_id_of, unwrap
from worker.client.window import ScoreWindow
from worker.client.workers import QueueState
from worker.config import DEFAULT_REDIS_URL
from worker.connections import connect, xadd_wait
from worker.protocol import Result
from worker.request import ScoreOptions

log = logging.getLogger(__name__)

T = TypeVar("T")


class ScoringClient(ClientBase):
    """Synchronous producer client; thread-safe. Use as a context manager or call ``close()``.

    ``redis_url`` may be ``redis://``, ``rediss://`` (TLS) or ``redis+cluster://``; pass
    ``partitions`` equal to the workers' ``--partitions``. Results are read by a background
    thread started on first use.
    """

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, *args: Any, **kwargs: Any) -> None:
        super().__init__(redis_url, *args, **kwargs)
        self.redis: Any = connect(self.settings)
        self._cond = threading.Condition()
        self._reader: threading.Thread | None = None
        self._closing = threading.Event()

    def __enter__(self) -> ScoringClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- effects

    def _run(self, steps: Steps[T]) -> T:
        """Perform the effects of one core operation; the core is only stepped under the lock."""
        reply: Any = None
        error: BaseException | None = None
        with self._cond:
            while True:
                try:
                    effect = steps.throw(error) if error is not None else steps.send(reply)
                except StopIteration as stop:
                    return stop.value
                reply, error = None, None
                try:
                    reply = self._perform(effect)
                except BaseException as exc:  # thrown into the operation (score forgets its job)
                    error = exc

    def _perform(self, effect: Effect) -> Any:
        """One effect; called and returning with the lock held, released around I/O."""
        core = self._core
        if isinstance(effect, Block):
            seen = effect.seen
            self._cond.wait_for(lambda: core.arrivals != seen or core.closed, effect.timeout_s)
            return None
        if isinstance(effect, Delivered):
            self._cond.notify_all()
            return None
        self._cond.release()
        try:
            if isinstance(effect, Command):
                return getattr(self.redis, effect.name)(*effect.args, **effect.kwargs)
            if isinstance(effect, DurableAdd):
                return xadd_wait(
                    self.redis, effect.stream, effect.fields, effect.replicas, effect.timeout_ms
                )
            if isinstance(effect, Pause):
                self._closing.wait(effect.seconds)
                return None
            return next(effect.source, END)  # NextItem
        finally:
            self._cond.acquire()

    # -- lifecycle

    def _ensure_reader(self) -> None:
        with self._cond:
            if self._core.closed:
                raise ClientClosed("the client is closed")
            if self._reader is None:
                self._reader = threading.Thread(
                    target=self._run,
                    args=(self._core.read_replies(),),
                    name=f"scoring-reply-{self.client_id}",
                    daemon=True,
                )
                self._reader.start()

    def close(self) -> None:
        """Stop the reader and delete the reply stream (or let it expire when jobs are
        outstanding or forgotten unanswered, so late results land in a key that has a TTL)."""
        with self._cond:
            if self._core.closed:
                return
            self._core.closed = True
        self._closing.set()
        try:
            if self._reader is not None:
                try:
                    self.redis.xadd(self.reply_stream, {WAKE_FIELD: b"1"})
                except redis.ResponseError as exc:  # a full Redis (OOM): the reader's block ends
                    log.debug("no wake-up entry on %s: %s", self.reply_stream, exc)
                self._reader.join(timeout=self.block_ms / 1000 + 5)
            self._run(self._core.close_reply_stream())  # DEL / EXPIRE: allowed when full
        except redis.RedisError as exc:
            log.warning("could not clean up reply stream %s: %s", self.reply_stream, exc)
        finally:
            with self._cond:
                self._cond.notify_all()
            self.redis.close()

    # -- producing

    def submit(
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
        """Enqueue one job and return its handle (``result(handle)`` waits for it); every
        argument is described in docs/client.md.

        ``seqs``: dicts (``tokens`` + ``prompt_len`` or ``mask``) or ``(tokens, prompt_len)``
        tuples. ``deadline_ms`` (unix ms) or ``expires_in_s``: ``expired`` past it. Teacher
        outputs (docs/distillation.md): ``outputs`` with ``topk``, shared ``gather_ids``,
        ``sampling``, ``float16``, ``hidden_dtype`` (of ``"hidden"`` rows: ``"bfloat16"``,
        ``"float32"``, ``"float16"``) and ``max_result_bytes`` (``too_large`` over it). Weights
        (docs/models.md): ``adapter``, ``version``. Process rewards: ``step``. ``options``: all
        job options as one ``ScoreOptions``. ``prefix``: token ids every sequence starts with,
        sent once. ``images`` (bytes, paths, PIL images) and ``processor`` (docs/client.md,
        "Images")."""
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
        return self._run(self._core.submit(job))

    def raw_result(self, handle_or_id: JobHandle | str, timeout: float | None = None) -> Result:
        """Wait for a job's wire ``Result`` (ok or error) without raising on error results."""
        self._ensure_reader()
        return self._run(self._core.wait_result(job_id_of(handle_or_id), timeout))

    def result(self, handle_or_id: JobHandle | str, timeout: float | None = None) -> ScoreResult:
        """Wait for a job's result; raises a ``JobFailed`` subclass for an error result and
        ``ScoringTimeout`` after ``timeout`` seconds (None waits forever). After a timeout the job
        is still tracked (wait again, or ``forget`` it)."""
        return unwrap(self.raw_result(handle_or_id, timeout))

    def live_workers(self, refresh: bool = False) -> int | None:
        """How many workers serve this queue now (live heartbeats); ``None`` when the server
        will not say. Cached after the first ask; ``refresh`` asks again."""
        return self._run(self._core.workers.count(refresh))

    def queue_state(self) -> QueueState:
        """Whether the queue is served now (live workers) or was (a consumer group): the state
        the queue rule reads (``worker.client.workers``)."""
        return self._run(self._core.workers.state())

    def forget(self, handle_or_id: JobHandle | str) -> bool:
        """Give up on a job: drop its buffered result and stop tracking it; a result arriving
        later is dropped (``late_results``). True if the job was outstanding or had a result
        waiting."""
        with self._cond:
            return self._core.forget(job_id_of(handle_or_id))

    def score(
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
        """Submit one job and wait for its scores (one ``SeqScore`` per sequence). On a timeout
        (or an interrupt) the job is forgotten: its late result is dropped."""
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
        return self._run(self._core.score(job, timeout))

    def score_groups(
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
        return self.score(seqs, mode, temperature, prefix=prompt, **kwargs)

    def score_cross_tokenizer(
        self, students: Sequence[Mapping[str, Any]], temperature: float = 1.0, **kwargs: Any
    ) -> list[SeqScore]:
        """Score student completions under a teacher with its own tokenizer (docs/distillation.md,
        *A teacher with its own tokenizer*): each item is a student view, ``prompt`` (text) or
        ``messages``, and ``tokens`` (the student's token strings) or ``completion`` with
        ``offsets`` (UTF-8 byte starts). One ``SeqScore`` each: teacher-token rows, and the
        ``span_*`` arrays aligned to the student's tokens. ``kwargs``: as ``score``
        (``outputs``, ``hidden_dtype``, ``max_result_bytes``...), less ``prefix`` and ``mode``
        (``BadRequestError``: the worker tokenizes each whole prompt, in mode ``reference``); a
        view carries no ``gather_ids`` (shared ``gather_ids=`` work)."""
        with client_checks("(score_cross_tokenizer)", kwargs.get("meta")):
            seqs = student_seqs(students, kwargs)
        return self.score(seqs, "reference", temperature, **kwargs)

    def score_many(
        self,
        jobs: Iterable[Any],
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
    ) -> Iterator[ScoreResult | JobFailed]:
        """Score many jobs with at most ``max_in_flight`` submitted and not yet answered.

        Each item is a list of sequences, a single sequence, a ``JobSpec`` or a map with
        ``seqs`` (and optional ``mode``, ``temperature``, ``meta``, ``id``). Yields one
        ``ScoreResult`` per job, in submission order (``ordered=True``; the window is then the
        oldest ``max_in_flight`` jobs) or as they complete. ``timeout`` bounds each job's wait
        from its submission (None: wait as long as it takes). With ``raise_errors=False`` a failed
        job yields its ``JobFailed`` instead of raising it. Jobs still in flight when the iterator
        stops (a timeout, a raised error, ``break``) are forgotten (see ``forget``).

        The teacher outputs (``outputs`` ... ``hidden_dtype``, as in ``score``) go to every job
        that names none of the six (``JobSpec`` or map) and is not a ``reward`` job;
        ``max_result_bytes`` to every such job without its own; ``step`` to ``reward`` jobs.
        """
        defaults = JobSpec(None, outputs=outputs, topk=topk, gather_ids=gather_ids,
                           sampling=sampling, float16=float16, hidden_dtype=hidden_dtype,
                           max_result_bytes=max_result_bytes, step=step)  # fmt: skip
        window = ScoreWindow(
            self._core, jobs, max_in_flight, ordered, timeout, mode, temperature, raise_errors,
            defaults,
        )  # fmt: skip
        self._ensure_reader()
        try:
            while (out := self._run(window.next())) is not None:
                yield out
        finally:
            with self._cond:
                window.close()
