"""The sans-I/O core of the producer clients: everything ``ScoringClient`` and
``AsyncScoringClient`` share, written once.

Each operation is a generator of *effects*: it yields what it needs done (a Redis ``Command``, a
``Block`` until results arrive, a ``Pause``, ``Delivered`` to wake waiters, the ``NextItem`` of
a job source) and receives the outcome (a reply is sent back, an error thrown in). The sync
client performs effects with blocking calls under its ``threading.Condition``, the asyncio client
with ``await``; neither holds any logic of its own (``worker.client.sync``, ``worker.client.aio``).

Here: the job payloads and handles, the reply buffer with de-duplication, the decoding and
dispatch of replies, timeouts, ``forget``, and the reply reader (``XREAD BLOCK``, ``XDEL`` of what
was read, a TTL kept on the key, back-off on connection errors). ``score_many``'s window is
``worker.client.window``.
"""

from __future__ import annotations

import logging
import time
import uuid
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis

from worker import errors, keys, protocol
from worker.client.buffer import ReplyBuffer
from worker.client.effects import (
    Block,
    Command,
    Delivered,
    DurableAdd,
    Pause,
    Steps,
)
from worker.client.errors import (
    ClientClosed,
    QueueFullError,
    ScoringTimeout,
    client_checks,
    is_out_of_memory,
)
from worker.client.images import job_images
from worker.client.inputs import normalize_seqs, output_request
from worker.client.resubmit import Resubmitter
from worker.client.results import JobHandle, SeqScore, unwrap
from worker.client.workers import WorkerCheck
from worker.config import DEFAULT_REDIS_URL, RedisSettings
from worker.modes import MODES
from worker.request import ScoreOptions, TokenOutputs

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The field of the entry ``close()`` adds to the reply stream to end a blocked ``XREAD``.
WAKE_FIELD = b"wake"
_FIRST_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 2.0
_SERVER_ERROR_PAUSE_S = 1.0


def new_job_id() -> str:
    """A fresh job id (128 random bits, hex)."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class PreparedJob:
    """A validated, encoded job that is ready to be added to its stream."""

    job_id: str
    stream: str
    payload: bytes
    num_seqs: int


class ClientCore:
    """The state and logic of one producer client (configuration, jobs in flight, reply buffer),
    without I/O. Not thread-safe: the sync client steps it under its lock."""

    def __init__(
        self,
        redis_url: str = DEFAULT_REDIS_URL,
        queue: str = keys.DEFAULT_QUEUE,
        partitions: int = 1,
        *,
        cluster: bool = False,
        ssl_ca_certs: str | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        ssl_check_hostname: bool = True,
        settings: RedisSettings | None = None,
        client_id: str | None = None,
        mode: str = "reference",
        reply_ttl_s: int = 3600,
        block_ms: int = 2000,
        limits: protocol.Limits = protocol.DEFAULT_LIMITS,
        resubmit_after_s: float | None = None,
        max_submits: int = 3,
        durable_replicas: int = 0,
        durable_timeout_ms: int = 1000,
        check_workers: bool = True,
        wait_for_unknown_queue: bool = False,
    ) -> None:
        self.client_id = client_id or uuid.uuid4().hex[:16]
        if settings is None:
            settings = RedisSettings(
                client_name=f"scoring-client-{self.client_id}",
                url=redis_url,
                cluster=cluster,
                ssl_ca_certs=ssl_ca_certs,
                ssl_certfile=ssl_certfile,
                ssl_keyfile=ssl_keyfile,
                ssl_check_hostname=ssl_check_hostname,
            )
        if mode not in MODES:
            raise errors.ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        if reply_ttl_s < 1:
            raise errors.ConfigError("reply_ttl_s must be >= 1")
        self.settings = settings
        self.queue = queue
        self.partitions = partitions
        self.job_streams = keys.job_streams(queue, partitions)
        self.reply_stream = keys.reply_stream(self.job_streams[0], self.client_id)
        self.mode = mode
        self.reply_ttl_s = int(reply_ttl_s)
        self.block_ms = int(block_ms)
        self.limits = limits
        self.buffer = ReplyBuffer()
        self.outstanding: dict[str, float] = {}  # job id -> submit time (monotonic)
        self.arrivals = 0  # bumped whenever new results are buffered (see Block)
        self.reconnects = 0
        self.closed = False
        # producer-side at-least-once (docs/guarantees.md)
        self.resubmitter = Resubmitter(resubmit_after_s, max_submits)
        if durable_replicas < 0 or durable_timeout_ms < 0:
            raise errors.ConfigError("durable_replicas and durable_timeout_ms must be >= 0")
        self.durable_replicas = int(durable_replicas)
        self.durable_timeout_ms = int(durable_timeout_ms)
        self.undurable = 0  # durable adds that fewer replicas than asked acknowledged in time
        # the queue rule (worker.client.workers): an unknown queue is refused before any XADD
        # unless wait_for_unknown_queue; check_workers=False: never asked, never refused
        self.workers = WorkerCheck(
            queue, self.job_streams, enabled=check_workers, wait_unknown=wait_for_unknown_queue
        )

    # -- jobs

    def stream_for(self, job_id: str) -> str:
        """The job stream (partition) of ``job_id``: a stable hash of the id."""
        if len(self.job_streams) == 1:
            return self.job_streams[0]
        return self.job_streams[zlib.crc32(job_id.encode()) % len(self.job_streams)]

    def prepare(
        self,
        seqs: Any,
        mode: str | None = None,
        temperature: float = 1.0,
        deadline_ms: int | None = None,
        expires_in_s: float | None = None,
        meta: Any = None,
        job_id: str | None = None,
        *,
        outputs: TokenOutputs | Mapping[str, Any] | None = None,
        adapter: str | None = None,
        version: str | None = None,
        step: Any = None,
        options: ScoreOptions | None = None,
        prefix: Any = None,
        images: Any = None,
        processor: Mapping[str, int] | None = None,
    ) -> PreparedJob:
        """Validate and encode a job (see ``ScoringClient.submit`` for the arguments); input
        the worker would reject raises ``BadRequestError`` here, before anything is sent."""
        job_id = job_id or new_job_id()
        with client_checks(job_id, meta):
            specs = normalize_seqs(seqs, prefix)  # whole sequences: a prefix goes on the wire once
            if expires_in_s is not None:
                deadline_ms = int((time.time() + expires_in_s) * 1000)
            payload = protocol.encode_job(
                job_id, mode or self.mode, self.reply_stream, specs, temperature=temperature,
                deadline_ms=deadline_ms, meta=meta, outputs=output_request(outputs, specs),
                adapter=adapter, step=step, version=version, options=options, prefix=prefix,
                images=job_images(images, processor),
            )  # fmt: skip
        return PreparedJob(job_id, self.stream_for(job_id), payload, len(specs))

    def timeout(self, job_id: str, waited_s: float) -> Steps[ScoringTimeout]:
        """The ``ScoringTimeout`` of ``job_id``, saying whether a worker serves the queue now."""
        hint = yield from self.workers.timeout_hint()
        return ScoringTimeout(job_id, waited_s, self.reply_stream, hint)

    def submit(self, job: PreparedJob) -> Steps[JobHandle]:
        """Add ``job`` to its stream; it counts as outstanding from before the ``XADD``. Until
        the queue is known, each submit applies the queue rule first (``WorkerCheck.admit``):
        an unknown queue raises ``UnknownQueueError`` and nothing is written. A job Redis
        refuses for memory raises ``QueueFullError`` (one ``XADD``: nothing of it is written)."""
        if self.closed:
            raise ClientClosed("the client is closed")
        yield from self.workers.admit()
        now = time.monotonic()
        self.outstanding[job.job_id] = now
        try:
            entry_id = yield from self._add(job)
        except BaseException as exc:
            self.outstanding.pop(job.job_id, None)
            if is_out_of_memory(exc):
                raise QueueFullError.refused(job.job_id, exc) from exc
            raise
        self.resubmitter.track(job.job_id, job, time.monotonic())
        eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        return JobHandle(job.job_id, job.stream, eid, now, job.num_seqs)

    def _add(self, job: PreparedJob) -> Steps[Any]:
        """``XADD`` the job (then ``WAIT`` for replicas when durable); its entry id."""
        fields = {protocol.PAYLOAD_FIELD: job.payload}
        if not self.durable_replicas:
            return (yield Command("xadd", (job.stream, fields)))
        entry_id, acked = yield DurableAdd(
            job.stream, fields, self.durable_replicas, self.durable_timeout_ms
        )
        if acked < self.durable_replicas:
            self.undurable += 1
            log.warning(
                "job %s: %d of %d replicas acknowledged it within %d ms",
                job.job_id, acked, self.durable_replicas, self.durable_timeout_ms,
            )  # fmt: skip
        return entry_id

    def _resubmit_due(self, job_ids: Sequence[str]) -> Steps[None]:
        """Add again, same id and payload, the jobs among ``job_ids`` whose result is overdue."""
        for job_id, job in self.resubmitter.due(job_ids, time.monotonic()):
            try:
                yield from self._add(job)
                log.info("job %s: no result yet, submitted again", job_id)
            except redis.RedisError as exc:  # Redis away (a failover): try again later
                log.warning("job %s: could not submit again (%s)", job_id, exc)
                self.resubmitter.retry_later(job_id, job, time.monotonic())

    def forget(self, job_id: str) -> bool:
        """Give up on ``job_id``: drop its buffered result, or drop its result on arrival."""
        outstanding = self.outstanding.pop(job_id, None) is not None
        self.resubmitter.done(job_id)
        return self.buffer.forget(job_id, outstanding)

    def keep_reply_stream(self) -> bool:
        """Whether results may still arrive (close() then sets a TTL instead of deleting)."""
        return bool(self.outstanding) or self.buffer.awaiting_late

    # -- waiting

    def wait_any(
        self, job_ids: Sequence[str], timeout_s: float | None
    ) -> Steps[tuple[str, protocol.Result] | None]:
        """The first of ``job_ids`` whose result has arrived, waiting up to ``timeout_s`` (None:
        as long as it takes); None once the time is up."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            for job_id in job_ids:
                result = self.buffer.take(job_id)
                if result is not None:
                    self.outstanding.pop(job_id, None)
                    self.resubmitter.done(job_id)
                    return job_id, result
            if self.closed:
                what = f"job {job_ids[0]}" if len(job_ids) == 1 else "results"
                raise ClientClosed(f"client closed while waiting for {what}")
            if self.resubmitter.enabled:
                yield from self._resubmit_due(job_ids)
            now = time.monotonic()
            remaining = None if deadline is None else deadline - now
            if remaining is not None and remaining <= 0:
                return None
            due = self.resubmitter.next_due(job_ids)
            if due is not None:  # wake up when the next job falls due
                remaining = (
                    max(due - now, 0.01)
                    if remaining is None
                    else min(remaining, max(due - now, 0.01))
                )
            yield Block(remaining, self.arrivals)

    def wait_result(self, job_id: str, timeout_s: float | None) -> Steps[protocol.Result]:
        """The wire result of ``job_id``; ``ScoringTimeout`` after ``timeout_s`` (the job stays
        tracked)."""
        start = time.monotonic()
        got = yield from self.wait_any([job_id], timeout_s)
        if got is None:
            raise (yield from self.timeout(job_id, time.monotonic() - start))
        return got[1]

    def score(self, job: PreparedJob, timeout_s: float | None) -> Steps[list[SeqScore]]:
        """Submit ``job`` and wait for its scores; the job is forgotten if the wait fails (a
        timeout, an interrupt, a cancellation): the caller has no handle to wait again with."""
        handle = yield from self.submit(job)
        try:
            return unwrap((yield from self.wait_result(handle.job_id, timeout_s))).seqs
        except BaseException:
            self.forget(handle.job_id)
            raise

    # -- reading replies

    def ingest(self, entries: Iterable[tuple[Any, Mapping[bytes, bytes]]]) -> int:
        """Decode reply entries into the buffer; returns how many new results arrived."""
        new = 0
        for entry_id, fields in entries:
            payload = fields.get(protocol.PAYLOAD_FIELD)
            if payload is None:
                continue  # a wake-up marker written by close()
            try:
                result = protocol.decode_result(payload, self.limits)
            except errors.ProtocolError as exc:
                log.warning("undecodable result %r on %s: %s", entry_id, self.reply_stream, exc)
                continue
            if self.buffer.offer(result, expected=result.id in self.outstanding):
                new += 1
        if new:
            self.arrivals += 1
        return new

    def read_replies(self) -> Steps[None]:
        """The reply reader, until the client closes: ``XREAD BLOCK`` the reply stream, buffer
        the results, ``XDEL`` what was read and keep a TTL on the key; connection errors are
        retried with back-off."""
        last_id: Any = b"0-0"
        backoff = _FIRST_BACKOFF_S
        next_expire = 0.0
        while not self.closed:
            try:
                next_expire = yield from self._keep_ttl(next_expire)
                reply = yield Command(
                    "xread", ({self.reply_stream: last_id},), {"block": self.block_ms}
                )
                backoff = _FIRST_BACKOFF_S
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if self.closed:
                    break
                self.reconnects += 1
                log.warning("reply reader: %s; retrying in %.2f s", exc, backoff)
                yield Pause(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
                continue
            except redis.RedisError as exc:  # a server reply (e.g. NOPERM): no traceback
                if self.closed:
                    break
                log.error("reply reader failed on %s: %s", self.reply_stream, exc)
                yield Pause(_SERVER_ERROR_PAUSE_S)
                continue
            entries = reply[0][1] if reply else None
            if not entries:
                continue
            last_id = entries[-1][0]
            if self.ingest(entries):
                yield Delivered()
            try:
                yield Command("xdel", (self.reply_stream, *[e[0] for e in entries]))
                next_expire = yield from self._keep_ttl(next_expire)
            except redis.RedisError as exc:  # harmless: the ids are behind last_id
                log.debug("xdel on %s failed: %s", self.reply_stream, exc)

    def _keep_ttl(self, next_expire: float) -> Steps[float]:
        """Refresh the reply stream's TTL when it is due; returns when it is due next."""
        now = time.monotonic()
        if now >= next_expire and (yield Command("expire", (self.reply_stream, self.reply_ttl_s))):
            return now + self.reply_ttl_s / 3  # the key exists and has a TTL
        return next_expire

    def close_reply_stream(self) -> Steps[None]:
        """Delete the reply stream, or give it a TTL when results may still arrive."""
        if self.keep_reply_stream():
            yield Command("expire", (self.reply_stream, self.reply_ttl_s))
        else:
            yield Command("delete", (self.reply_stream,))
