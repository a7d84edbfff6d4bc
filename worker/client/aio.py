"""The asyncio producer client (``redis.asyncio``); same semantics as ``worker.client``.

::

    async with AsyncScoringClient("redis://127.0.0.1:6379/0") as client:
        scores = await client.score(rollouts, timeout=60)
        async for result in client.score_many(jobs, max_in_flight=32, ordered=False):
            ...

A reader task owns the reply stream; results for any job id are buffered until awaited.
No torch import.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any

import redis

from worker import client as _sync
from worker import protocol
from worker.client import (
    DEFAULT_URL,
    ClientClosed,
    JobFailed,
    JobHandle,
    ScoreResult,
    ScoringTimeout,
    SeqScore,
    _ClientBase,
    _job_id,
    as_job_spec,
    job_failed,
    unwrap,
)
from worker.config import RedisSettings
from worker.connections import connect_async

log = logging.getLogger(__name__)


class AsyncScoringClient(_ClientBase):
    """Asyncio producer client. Use ``async with`` or ``await client.close()``.

    Same constructor arguments as ``ScoringClient``. Create it inside the running loop.
    """

    def __init__(self, redis_url: str = DEFAULT_URL, *args: Any, **kwargs: Any) -> None:
        super().__init__(redis_url, *args, **kwargs)
        self.redis: Any = connect_async(self.settings)
        self._cond: asyncio.Condition | None = None
        self._reader: asyncio.Task[None] | None = None
        self._closed = False
        self.reconnects = 0

    @classmethod
    def from_settings(cls, settings: RedisSettings, **kwargs: Any) -> AsyncScoringClient:
        """Build from a ``RedisSettings``."""
        return cls(settings.url, settings=settings, **kwargs)

    async def __aenter__(self) -> AsyncScoringClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _ensure_reader(self) -> asyncio.Condition:
        if self._closed:
            raise ClientClosed("the client is closed")
        if self._cond is None:
            self._cond = asyncio.Condition()
        if self._reader is None:
            self._reader = asyncio.create_task(self._read_loop(), name=f"reply-{self.client_id}")
        return self._cond

    async def close(self) -> None:
        """Stop the reader task and delete the reply stream (TTL when jobs are outstanding or
        were forgotten unanswered)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._reader is not None:
                self._reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._reader
            if self._keep_reply_stream():
                await self.redis.expire(self.reply_stream, self.reply_ttl_s)
            else:
                await self.redis.delete(self.reply_stream)
        except redis.RedisError as exc:
            log.warning("could not clean up reply stream %s: %s", self.reply_stream, exc)
        finally:
            if self._cond is not None:
                async with self._cond:
                    self._cond.notify_all()
            await self.redis.aclose()

    async def _read_loop(self) -> None:
        assert self._cond is not None
        last_id: Any = b"0-0"
        backoff = 0.05
        next_expire = 0.0
        while not self._closed:
            try:
                now = time.monotonic()
                if now >= next_expire and await self.redis.expire(
                    self.reply_stream, self.reply_ttl_s
                ):
                    next_expire = now + self.reply_ttl_s / 3  # the key exists and has a TTL
                reply = await self.redis.xread({self.reply_stream: last_id}, block=self.block_ms)
                backoff = 0.05
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                self.reconnects += 1
                log.warning("reply reader: %s; retrying in %.2f s", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            except redis.RedisError as exc:  # a server reply (e.g. NOPERM): no traceback
                log.error("reply reader failed on %s: %s", self.reply_stream, exc)
                await asyncio.sleep(1.0)
                continue
            if not reply:
                continue
            entries = reply[0][1]
            if not entries:
                continue
            last_id = entries[-1][0]
            async with self._cond:
                if self._decode_entries(entries):
                    self._cond.notify_all()
            try:
                await self.redis.xdel(self.reply_stream, *[e[0] for e in entries])
                now = time.monotonic()
                if now >= next_expire and await self.redis.expire(
                    self.reply_stream, self.reply_ttl_s
                ):
                    next_expire = now + self.reply_ttl_s / 3
            except redis.RedisError as exc:
                log.debug("xdel on %s failed: %s", self.reply_stream, exc)

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
    ) -> JobHandle:
        """Enqueue one job (see ``ScoringClient.submit``)."""
        self._ensure_reader()
        job_id, stream, payload, n = self._encode(
            seqs, mode, temperature, deadline_ms, expires_in_s, meta, job_id
        )
        now = time.monotonic()
        self._outstanding[job_id] = now
        try:
            entry_id = await self.redis.xadd(stream, {protocol.PAYLOAD_FIELD: payload})
        except BaseException:
            self._outstanding.pop(job_id, None)
            raise
        eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        return JobHandle(job_id, stream, eid, now, n)

    async def _wait_any(
        self, job_ids: Iterable[str], timeout: float | None
    ) -> tuple[str, protocol.Result] | None:
        cond = self._ensure_reader()
        ids = list(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        async with cond:
            while True:
                for job_id in ids:
                    result = self._buffer.take(job_id)
                    if result is not None:
                        self._outstanding.pop(job_id, None)
                        return job_id, result
                if self._closed:
                    raise ClientClosed("client closed while waiting for results")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(cond.wait(), remaining)

    async def raw_result(
        self, handle_or_id: JobHandle | str, timeout: float | None = None
    ) -> protocol.Result:
        """Wait for a job's wire ``Result`` (ok or error) without raising on error results."""
        job_id = _job_id(handle_or_id)
        start = time.monotonic()
        got = await self._wait_any([job_id], timeout)
        if got is None:
            raise ScoringTimeout(job_id, time.monotonic() - start, self.reply_stream)
        return got[1]

    async def result(
        self, handle_or_id: JobHandle | str, timeout: float | None = None
    ) -> ScoreResult:
        """Wait for a job's result; raises ``JobFailed`` subclasses / ``ScoringTimeout``. After a
        timeout the job is still tracked (wait again, or ``forget`` it)."""
        return unwrap(await self.raw_result(handle_or_id, timeout))

    def forget(self, handle_or_id: JobHandle | str) -> bool:
        """Give up on a job (see ``ScoringClient.forget``); a plain method, not a coroutine."""
        return self._forget(_job_id(handle_or_id))

    async def score(
        self,
        seqs: Any,
        mode: str | None = None,
        temperature: float = 1.0,
        *,
        timeout: float | None = 300.0,
        meta: Any = None,
        expires_in_s: float | None = None,
    ) -> list[SeqScore]:
        """Submit one job and await its scores; forgotten on a timeout or cancellation."""
        handle = await self.submit(seqs, mode, temperature, meta=meta, expires_in_s=expires_in_s)
        try:
            return (await self.result(handle, timeout)).seqs
        except BaseException:
            self.forget(handle)
            raise

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
    ) -> AsyncIterator[ScoreResult | JobFailed]:
        """Async generator twin of ``ScoringClient.score_many`` (sync or async iterable in).

        ``timeout=None`` waits as long as it takes; jobs still in flight when it stops are
        forgotten."""
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        if isinstance(jobs, AsyncIterable):
            ait = jobs.__aiter__()
        else:
            sync_it = iter(jobs)

            async def _gen() -> AsyncIterator[Any]:
                for item in sync_it:
                    yield item

            ait = _gen()
        # job id -> (submitted at, deadline), both monotonic
        pending: OrderedDict[str, tuple[float, float]] = OrderedDict()
        exhausted = False
        try:
            while True:
                while not exhausted and len(pending) < max_in_flight:
                    try:
                        item = await ait.__anext__()
                    except StopAsyncIteration:
                        exhausted = True
                        break
                    spec = as_job_spec(item)
                    handle = await self.submit(
                        spec.seqs,
                        spec.mode or mode,
                        spec.temperature if spec.temperature is not None else temperature,
                        deadline_ms=spec.deadline_ms,
                        meta=spec.meta,
                        job_id=spec.job_id,
                    )
                    start = handle.submitted_at
                    limit = float("inf") if timeout is None else start + timeout
                    pending[handle.job_id] = (start, limit)
                if not pending:
                    return
                head, (head_start, head_deadline) = next(iter(pending.items()))
                while True:  # bounded slices, as in the sync client
                    wait_s = min(head_deadline - time.monotonic(), _sync._WAIT_SLICE_S)
                    got = await self._wait_any(
                        [head] if ordered else list(pending), max(wait_s, 0.0)
                    )
                    if got is not None:
                        break
                    now = time.monotonic()
                    if now >= head_deadline:
                        raise ScoringTimeout(head, now - head_start, self.reply_stream)
                job_id, raw = got
                del pending[job_id]
                if raw.ok:
                    yield ScoreResult.from_wire(raw)
                elif raise_errors:
                    raise job_failed(raw)
                else:
                    yield job_failed(raw)
        finally:
            if pending:
                log.debug("score_many stopped with %d jobs in flight: forgotten", len(pending))
                for pending_id in pending:
                    self._forget(pending_id)


__all__ = ["AsyncScoringClient"]
