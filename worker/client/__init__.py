"""The producer API: submit rollouts to the scoring queue and read their scores back.

Three lines score a batch::

    from worker.client import ScoringClient
    with ScoringClient("redis://127.0.0.1:6379/0") as client:
        scores = client.score([{"tokens": ids, "prompt_len": 12}, (ids2, 7)], timeout=60)

This module imports redis, msgpack and the standard library only (numpy when it is installed):
never torch or transformers. Torch tensors and numpy arrays are accepted duck-typed.

Each client owns one reply stream (``keys.reply_stream(job_streams[0], client_id)``). A background
thread reads it with ``XREAD BLOCK``, buffers results by job id, deletes what it read (``XDEL``),
keeps a TTL on the key, and drops duplicate results (``client.duplicates``). ``close()`` deletes the
stream, or leaves it to expire when jobs are still outstanding.

Memory stays bounded: a job the caller gives up on (``forget``; ``score`` after a timeout;
``score_many`` for the jobs still in flight when it stops) is dropped with its buffered result, and
its late result is dropped on arrival (``client.late_results``). Results for job ids the client is
not waiting for are kept up to ``MAX_UNCLAIMED_RESULTS``, oldest dropped first.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
import uuid
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from worker import errors, keys, protocol
from worker.config import RedisSettings
from worker.connections import connect

try:  # numpy is optional on the producer side
    import numpy as _np
except ImportError:  # pragma: no cover - depends on the environment
    _np = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

DEFAULT_URL = "redis://127.0.0.1:6379/0"
WAKE_FIELD = b"wake"
_DELIVERED_MEMORY = 100_000  # job ids remembered for duplicate suppression
#: Results kept for job ids this client is not waiting for (not submitted by it, e.g. picked up by a
#: restarted producer with a fixed ``client_id``); past this the oldest are dropped.
MAX_UNCLAIMED_RESULTS = 10_000
_WAIT_SLICE_S = 60.0  # score_many waits in slices of this (timeout=None waits forever)


# ----------------------------------------------------------------------------- errors


class JobFailed(errors.ScoringError):
    """A job came back with an error result; ``code``, ``message``, ``job_id`` say which and why."""

    def __init__(
        self, job_id: str, message: str, *, info: Mapping[str, Any] | None = None, meta: Any = None
    ) -> None:
        super().__init__(f"job {job_id} failed [{self.code}]: {message}")
        self.job_id = job_id
        self.reason = message
        self.info = dict(info or {})
        self.meta = meta


class BadRequestError(JobFailed, errors.BadRequest):
    """The worker rejected the job as malformed (``bad_request``)."""


class TooLongError(JobFailed, errors.TooLong):
    """A sequence is longer than the worker's model accepts (``too_long``)."""


class UnsupportedModeError(JobFailed, errors.UnsupportedMode):
    """The worker does not serve the requested mode (``unsupported_mode``)."""


class ExpiredError(JobFailed, errors.Expired):
    """The job was still queued after its deadline (``expired``)."""


class DeadLetterError(JobFailed, errors.DeadLetter):
    """The job was dead-lettered after too many deliveries (``dead_letter``)."""


class InternalJobError(JobFailed, errors.InternalError):
    """The worker failed unexpectedly on this job (``internal`` or an unknown code)."""


_FAILED_BY_CODE: dict[str, type[JobFailed]] = {
    "bad_request": BadRequestError,
    "too_long": TooLongError,
    "unsupported_mode": UnsupportedModeError,
    "expired": ExpiredError,
    "dead_letter": DeadLetterError,
    "internal": InternalJobError,
}


def job_failed(result: protocol.Result) -> JobFailed:
    """The typed exception for an error result (unknown codes become ``InternalJobError``)."""
    err = result.error or {}
    code = str(err.get("code", "internal"))
    message = str(err.get("message", ""))
    cls = _FAILED_BY_CODE.get(code)
    if cls is None:
        cls, message = InternalJobError, f"[{code}] {message}"
    return cls(result.id, message, info=result.info, meta=result.meta)


class ScoringTimeout(TimeoutError):
    """No result arrived in time; ``job_id`` and ``waited_s`` say for which job and how long."""

    def __init__(self, job_id: str, waited_s: float, reply_stream: str = "") -> None:
        where = f" on {reply_stream}" if reply_stream else ""
        super().__init__(
            f"no result for job {job_id} after waiting {waited_s:.1f} s{where} "
            "(is a worker serving this queue? see `scoring-worker info`)"
        )
        self.job_id = job_id
        self.waited_s = waited_s


class ClientClosed(RuntimeError):
    """The client was closed while a caller waited on it."""


# ----------------------------------------------------------------------------- results


def _float_array(values: array | None) -> Any:
    if values is None:
        return None
    if _np is not None:
        return _np.frombuffer(values.tobytes(), dtype=_np.float32)
    return values


@dataclass(frozen=True)
class SeqScore:
    """Scores of one sequence: completion-token log-probs (float32 array) and/or a reward."""

    logps: Any = None  # numpy float32 array when numpy is installed, else array('f')
    reward: float | None = None
    token_scores: Any = None

    @property
    def num_tokens(self) -> int:
        """How many completion tokens were scored (0 without log-probs)."""
        return 0 if self.logps is None else len(self.logps)

    @property
    def sum_logp(self) -> float | None:
        """Sum of the completion log-probs (the sequence log-likelihood)."""
        return None if self.logps is None else float(sum(float(x) for x in self.logps))

    @property
    def mean_logp(self) -> float | None:
        """Mean log-prob per scored token."""
        n = self.num_tokens
        return None if not n else (self.sum_logp or 0.0) / n

    def to_json(self) -> dict[str, Any]:
        """A JSON-friendly dict (log-probs as a list of floats)."""
        out: dict[str, Any] = {}
        if self.logps is not None:
            out["logps"] = [float(x) for x in self.logps]
        if self.reward is not None:
            out["reward"] = float(self.reward)
        if self.token_scores is not None:
            out["token_scores"] = [float(x) for x in self.token_scores]
        return out


@dataclass(frozen=True)
class ScoreResult:
    """The successful result of one job: one ``SeqScore`` per submitted sequence, in order."""

    job_id: str
    seqs: list[SeqScore]
    info: dict[str, Any] = field(default_factory=dict)
    meta: Any = None

    def __len__(self) -> int:
        return len(self.seqs)

    def __iter__(self) -> Iterator[SeqScore]:
        return iter(self.seqs)

    def __getitem__(self, index: int) -> SeqScore:
        return self.seqs[index]

    @classmethod
    def from_wire(cls, result: protocol.Result) -> ScoreResult:
        """Build from a decoded ``ok`` wire result."""
        return cls(
            job_id=result.id,
            seqs=[
                SeqScore(
                    logps=_float_array(s.logps),
                    reward=s.reward,
                    token_scores=_float_array(s.token_scores),
                )
                for s in result.seqs
            ],
            info=dict(result.info or {}),
            meta=result.meta,
        )


@dataclass(frozen=True)
class JobHandle:
    """What ``submit`` returns: the job id, where it went, and when."""

    job_id: str
    stream: str
    entry_id: str
    submitted_at: float  # time.monotonic()
    num_seqs: int


# ----------------------------------------------------------------------------- inputs


def _prompt_len(value: Any, index: int) -> int:
    """``prompt_len`` as an int (numpy/torch integer scalars accepted; booleans, floats not)."""
    if protocol.is_bool_like(value):
        raise errors.BadRequest(f"seqs[{index}]: prompt_len must be an integer, got a boolean")
    try:
        return operator.index(value)
    except TypeError as exc:
        raise errors.BadRequest(
            f"seqs[{index}]: prompt_len must be an integer, got {type(value).__name__}"
        ) from exc


def normalize_seq(seq: Any, index: int = 0) -> protocol.SeqSpec:
    """One sequence from a dict (``tokens`` + ``prompt_len`` or ``mask``), a ``(tokens,
    prompt_len)`` tuple or a ``SeqSpec``; tokens may be a list, numpy array or torch tensor."""
    if isinstance(seq, protocol.SeqSpec):
        return seq
    if isinstance(seq, Mapping):
        if "tokens" not in seq:
            raise errors.BadRequest(f"seqs[{index}]: a sequence map needs 'tokens'")
        spec = {"tokens": seq["tokens"], "prompt_len": seq.get("prompt_len"), "mask": None}
        if seq.get("mask") is not None:
            spec["mask"] = seq["mask"]
    elif isinstance(seq, tuple) and len(seq) == 2:
        tokens, second = seq
        if protocol.is_bool_like(second):  # True would pass operator.index as 1
            raise errors.BadRequest(f"seqs[{index}]: prompt_len must be an integer, got a boolean")
        try:
            spec = {"tokens": tokens, "prompt_len": operator.index(second), "mask": None}
        except TypeError:
            spec = {"tokens": tokens, "prompt_len": None, "mask": second}
    else:
        raise errors.BadRequest(
            f"seqs[{index}]: expected a dict with tokens and prompt_len/mask or a "
            f"(tokens, prompt_len) tuple, got {type(seq).__name__}"
        )
    if spec["prompt_len"] is not None:
        spec["prompt_len"] = _prompt_len(spec["prompt_len"], index)  # numpy/torch scalars too
    tokens = protocol.as_int32_array(spec["tokens"])
    mask = protocol.as_mask_bytes(spec["mask"]) if spec["mask"] is not None else None
    protocol.validate_seq(tokens, spec["prompt_len"], mask, index)
    return protocol.SeqSpec(tokens=tokens, prompt_len=spec["prompt_len"], mask=mask)


def normalize_seqs(seqs: Any) -> list[protocol.SeqSpec]:
    """A job's sequences; a single dict/tuple sequence is accepted as a one-sequence job."""
    if isinstance(seqs, (Mapping, protocol.SeqSpec)) or (
        isinstance(seqs, tuple) and len(seqs) == 2 and not isinstance(seqs[1], (Mapping, tuple))
    ):
        seqs = [seqs]
    out = [normalize_seq(s, i) for i, s in enumerate(seqs)]
    if not out:
        raise errors.BadRequest("a job needs at least one sequence")
    return out


@dataclass(frozen=True)
class JobSpec:
    """One job for ``score_many``: its sequences and optional per-job settings."""

    seqs: Any
    mode: str | None = None
    temperature: float | None = None
    meta: Any = None
    job_id: str | None = None
    deadline_ms: int | None = None


def as_job_spec(item: Any) -> JobSpec:
    """A ``JobSpec`` from a ``JobSpec``, a map with ``seqs`` (and ``mode``/``meta``/``id``...), a
    single sequence map with ``tokens``, or a list of sequences."""
    if isinstance(item, JobSpec):
        return item
    if isinstance(item, Mapping) and "seqs" in item:
        return JobSpec(
            seqs=item["seqs"],
            mode=item.get("mode"),
            temperature=item.get("temperature"),
            meta=item.get("meta"),
            job_id=item.get("job_id", item.get("id")),
            deadline_ms=item.get("deadline_ms"),
        )
    return JobSpec(seqs=item)


# ----------------------------------------------------------------------------- buffer


class ReplyBuffer:
    """Results by job id, with duplicate suppression and bounded memory. Not thread-safe; callers
    lock.

    ``ready``: arrived, not taken yet. ``delivered``: the last ``remember`` job ids taken or
    forgotten (a later result for one is a duplicate). ``abandoned``: forgotten jobs whose result
    has not arrived (the last ``remember``); their result is dropped on arrival and counted in
    ``late``. ``unclaimed``: buffered results nobody was waiting for (``offer(expected=False)``),
    at most ``max_unclaimed``, the oldest dropped first (counted in ``evicted``).
    """

    def __init__(
        self, remember: int = _DELIVERED_MEMORY, max_unclaimed: int = MAX_UNCLAIMED_RESULTS
    ) -> None:
        self.ready: dict[str, protocol.Result] = {}
        self.delivered: OrderedDict[str, None] = OrderedDict()
        self.abandoned: OrderedDict[str, None] = OrderedDict()
        self.unclaimed: OrderedDict[str, None] = OrderedDict()
        self.remember = remember
        self.max_unclaimed = max_unclaimed
        self.duplicates = 0
        self.late = 0
        self.evicted = 0
        self.abandoned_overflow = False  # some abandoned ids were forgotten for good

    @property
    def awaiting_late(self) -> bool:
        """Whether results of abandoned jobs may still arrive."""
        return bool(self.abandoned) or self.abandoned_overflow

    def _remember(self, job_id: str) -> None:
        self.delivered[job_id] = None
        while len(self.delivered) > self.remember:
            self.delivered.popitem(last=False)

    def offer(self, result: protocol.Result, expected: bool = True) -> bool:
        """Buffer ``result``; False when it is dropped: a duplicate (its job id was already seen,
        counted in ``duplicates``) or the late result of an abandoned job (counted in ``late``).
        ``expected=False``: nobody waits for this job id, so it counts against ``max_unclaimed``."""
        job_id = result.id
        if job_id in self.abandoned:
            del self.abandoned[job_id]
            self._remember(job_id)
            self.late += 1
            log.debug("dropped the late result of abandoned job %s", job_id)
            return False
        if job_id in self.ready or job_id in self.delivered:
            self.duplicates += 1
            log.debug("dropped duplicate result for job %s", job_id)
            return False
        self.ready[job_id] = result
        if not expected:
            self.unclaimed[job_id] = None
            while len(self.unclaimed) > self.max_unclaimed:
                oldest, _ = self.unclaimed.popitem(last=False)
                self.ready.pop(oldest, None)
                self.evicted += 1
                log.warning("dropped the unclaimed result of job %s (buffer full)", oldest)
        return True

    def take(self, job_id: str) -> protocol.Result | None:
        """Remove and return the result of ``job_id`` if it has arrived."""
        result = self.ready.pop(job_id, None)
        if result is not None:
            self.unclaimed.pop(job_id, None)
            self._remember(job_id)
        return result

    def forget(self, job_id: str, outstanding: bool) -> bool:
        """Drop ``job_id``'s buffered result, or, when it is ``outstanding`` and its result has not
        arrived, mark it abandoned so that result is dropped on arrival. True if anything was
        dropped or marked."""
        if self.ready.pop(job_id, None) is not None:
            self.unclaimed.pop(job_id, None)
            self._remember(job_id)
            return True
        if not outstanding:
            return False
        self.abandoned[job_id] = None
        while len(self.abandoned) > self.remember:
            self.abandoned.popitem(last=False)
            self.abandoned_overflow = True
        return True


def unwrap(result: protocol.Result) -> ScoreResult:
    """A ``ScoreResult`` for an ok result; raises the typed ``JobFailed`` otherwise."""
    if not result.ok:
        raise job_failed(result)
    return ScoreResult.from_wire(result)


def _job_id(handle_or_id: JobHandle | str) -> str:
    return handle_or_id.job_id if isinstance(handle_or_id, JobHandle) else str(handle_or_id)


# ----------------------------------------------------------------------------- the client


class _ClientBase:
    """Configuration shared by the sync and async clients (no I/O here)."""

    def __init__(
        self,
        redis_url: str = DEFAULT_URL,
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
        if mode not in protocol.MODES:
            raise errors.ConfigError(f"mode must be one of {protocol.MODES}, got {mode!r}")
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
        self._buffer = ReplyBuffer()
        self._outstanding: dict[str, float] = {}  # job id -> submit time (monotonic)

    @property
    def duplicates(self) -> int:
        """How many duplicate results (same job id) were dropped."""
        return self._buffer.duplicates

    @property
    def outstanding(self) -> int:
        """Jobs submitted whose result has not been taken (nor the job forgotten) yet."""
        return len(self._outstanding)

    @property
    def late_results(self) -> int:
        """How many results of forgotten jobs arrived late and were dropped."""
        return self._buffer.late

    @property
    def evicted_results(self) -> int:
        """How many unclaimed results were dropped because ``MAX_UNCLAIMED_RESULTS`` were held."""
        return self._buffer.evicted

    def _forget(self, job_id: str) -> bool:
        """``forget`` without the lock (callers hold it)."""
        outstanding = self._outstanding.pop(job_id, None) is not None
        return self._buffer.forget(job_id, outstanding)

    def _keep_reply_stream(self) -> bool:
        """Whether results may still arrive (close() then sets a TTL instead of deleting)."""
        return bool(self._outstanding) or self._buffer.awaiting_late

    def stream_for(self, job_id: str) -> str:
        """The job stream (partition) of ``job_id``: a stable hash of the id."""
        if len(self.job_streams) == 1:
            return self.job_streams[0]
        return self.job_streams[zlib.crc32(job_id.encode()) % len(self.job_streams)]

    def _encode(
        self,
        seqs: Any,
        mode: str | None,
        temperature: float,
        deadline_ms: int | None,
        expires_in_s: float | None,
        meta: Any,
        job_id: str | None,
    ) -> tuple[str, str, bytes, int]:
        specs = normalize_seqs(seqs)
        job_id = job_id or uuid.uuid4().hex
        if expires_in_s is not None:
            deadline_ms = int((time.time() + expires_in_s) * 1000)
        payload = protocol.encode_job(
            job_id,
            mode or self.mode,
            self.reply_stream,
            specs,
            temperature=temperature,
            deadline_ms=deadline_ms,
            meta=meta,
        )
        return job_id, self.stream_for(job_id), payload, len(specs)

    def _decode_entries(self, entries: Iterable[tuple[Any, Mapping[bytes, bytes]]]) -> int:
        """Offer decoded results to the buffer; returns how many new results arrived."""
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
            if self._buffer.offer(result, expected=result.id in self._outstanding):
                new += 1
        return new


class ScoringClient(_ClientBase):
    """Synchronous producer client; thread-safe. Use as a context manager or call ``close()``.

    ``redis_url`` may be ``redis://``, ``rediss://`` (TLS) or ``redis+cluster://``; pass
    ``partitions`` equal to the workers' ``--partitions``. Results are read by a background
    thread started on first use.
    """

    def __init__(self, redis_url: str = DEFAULT_URL, *args: Any, **kwargs: Any) -> None:
        super().__init__(redis_url, *args, **kwargs)
        self.redis: Any = connect(self.settings)
        self._cond = threading.Condition()
        self._reader: threading.Thread | None = None
        self._closing = threading.Event()
        self._closed = False
        self.reconnects = 0

    @classmethod
    def from_settings(cls, settings: RedisSettings, **kwargs: Any) -> ScoringClient:
        """Build from a ``RedisSettings`` (as the CLI does)."""
        return cls(settings.url, settings=settings, **kwargs)

    # -- lifecycle

    def __enter__(self) -> ScoringClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ensure_reader(self) -> None:
        if self._closed:
            raise ClientClosed("the client is closed")
        if self._reader is None:
            self._reader = threading.Thread(
                target=self._read_loop, name=f"scoring-reply-{self.client_id}", daemon=True
            )
            self._reader.start()

    def close(self) -> None:
        """Stop the reader and delete the reply stream (or let it expire when jobs are
        outstanding or forgotten unanswered, so late results land in a key that has a TTL)."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        try:
            if self._reader is not None:
                self.redis.xadd(self.reply_stream, {WAKE_FIELD: b"1"})
                self._reader.join(timeout=self.block_ms / 1000 + 5)
            if self._keep_reply_stream():
                self.redis.expire(self.reply_stream, self.reply_ttl_s)
            else:
                self.redis.delete(self.reply_stream)
        except redis.RedisError as exc:
            log.warning("could not clean up reply stream %s: %s", self.reply_stream, exc)
        finally:
            with self._cond:
                self._cond.notify_all()
            self.redis.close()

    # -- reading

    def _read_loop(self) -> None:
        last_id = b"0-0"
        backoff = 0.05
        next_expire = 0.0
        while not self._closing.is_set():
            try:
                now = time.monotonic()
                if now >= next_expire and self.redis.expire(self.reply_stream, self.reply_ttl_s):
                    next_expire = now + self.reply_ttl_s / 3  # the key exists and has a TTL
                reply = self.redis.xread({self.reply_stream: last_id}, block=self.block_ms)
                backoff = 0.05
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if self._closing.is_set():
                    break
                self.reconnects += 1
                log.warning("reply reader: %s; retrying in %.2f s", exc, backoff)
                self._closing.wait(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            except redis.RedisError as exc:  # a server reply (e.g. NOPERM): no traceback
                if self._closing.is_set():
                    break
                log.error("reply reader failed on %s: %s", self.reply_stream, exc)
                self._closing.wait(1.0)
                continue
            if not reply:
                continue
            entries = reply[0][1]
            if not entries:
                continue
            last_id = entries[-1][0]
            with self._cond:
                if self._decode_entries(entries):
                    self._cond.notify_all()
            try:
                self.redis.xdel(self.reply_stream, *[e[0] for e in entries])
                now = time.monotonic()
                if now >= next_expire and self.redis.expire(self.reply_stream, self.reply_ttl_s):
                    next_expire = now + self.reply_ttl_s / 3
            except redis.RedisError as exc:  # harmless: the ids are behind last_id
                log.debug("xdel on %s failed: %s", self.reply_stream, exc)

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
    ) -> JobHandle:
        """Enqueue one job and return its handle (``result(handle)`` waits for it).

        ``seqs``: sequences as dicts (``tokens`` + ``prompt_len`` or ``mask``) or
        ``(tokens, prompt_len)`` tuples. ``deadline_ms`` (unix ms) or ``expires_in_s``: the worker
        answers ``expired`` instead of scoring a job still queued after that.
        """
        self._ensure_reader()
        job_id, stream, payload, n = self._encode(
            seqs, mode, temperature, deadline_ms, expires_in_s, meta, job_id
        )
        now = time.monotonic()
        with self._cond:
            self._outstanding[job_id] = now
        try:
            entry_id = self.redis.xadd(stream, {protocol.PAYLOAD_FIELD: payload})
        except BaseException:
            with self._cond:
                self._outstanding.pop(job_id, None)
            raise
        eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        return JobHandle(job_id, stream, eid, now, n)

    def raw_result(self, handle_or_id: JobHandle | str, timeout: float | None = None) -> Any:
        """Wait for a job's wire ``Result`` (ok or error) without raising on error results."""
        job_id = _job_id(handle_or_id)
        self._ensure_reader()
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        with self._cond:
            while True:
                result = self._buffer.take(job_id)
                if result is not None:
                    self._outstanding.pop(job_id, None)
                    return result
                if self._closed:
                    raise ClientClosed(f"client closed while waiting for job {job_id}")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise ScoringTimeout(job_id, time.monotonic() - start, self.reply_stream)
                self._cond.wait(remaining)

    def result(self, handle_or_id: JobHandle | str, timeout: float | None = None) -> ScoreResult:
        """Wait for a job's result; raises a ``JobFailed`` subclass for an error result and
        ``ScoringTimeout`` after ``timeout`` seconds (None waits forever). After a timeout the job
        is still tracked (wait again, or ``forget`` it)."""
        return unwrap(self.raw_result(handle_or_id, timeout))

    def forget(self, handle_or_id: JobHandle | str) -> bool:
        """Give up on a job: drop its buffered result and stop tracking it; a result arriving
        later is dropped (``late_results``). True if the job was outstanding or had a result
        waiting."""
        with self._cond:
            return self._forget(_job_id(handle_or_id))

    def score(
        self,
        seqs: Any,
        mode: str | None = None,
        temperature: float = 1.0,
        *,
        timeout: float | None = 300.0,
        meta: Any = None,
        expires_in_s: float | None = None,
    ) -> list[SeqScore]:
        """Submit one job and wait for its scores (one ``SeqScore`` per sequence). On a timeout
        (or an interrupt) the job is forgotten: its late result is dropped."""
        handle = self.submit(seqs, mode, temperature, meta=meta, expires_in_s=expires_in_s)
        try:
            return self.result(handle, timeout).seqs
        except BaseException:
            self.forget(handle)  # the caller has no handle to wait again with
            raise

    def _wait_any(self, job_ids: Iterable[str], timeout: float) -> tuple[str, Any] | None:
        """The first of ``job_ids`` whose result has arrived, waiting up to ``timeout``."""
        ids = list(job_ids)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for job_id in ids:
                    result = self._buffer.take(job_id)
                    if result is not None:
                        self._outstanding.pop(job_id, None)
                        return job_id, result
                if self._closed:
                    raise ClientClosed("client closed while waiting for results")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)

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
    ) -> Iterator[ScoreResult | JobFailed]:
        """Score many jobs with at most ``max_in_flight`` submitted and not yet answered.

        Each item is a list of sequences, a single sequence, a ``JobSpec`` or a map with
        ``seqs`` (and optional ``mode``, ``temperature``, ``meta``, ``id``). Yields one
        ``ScoreResult`` per job, in submission order (``ordered=True``; the window is then the
        oldest ``max_in_flight`` jobs) or as they complete. ``timeout`` bounds each job's wait
        from its submission (None: wait as long as it takes). With ``raise_errors=False`` a failed
        job yields its ``JobFailed`` instead of raising it. Jobs still in flight when the iterator
        stops (a timeout, a raised error, ``break``) are forgotten (see ``forget``).
        """
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        # job id -> (submitted at, deadline), both monotonic
        pending: OrderedDict[str, tuple[float, float]] = OrderedDict()
        it = iter(jobs)
        exhausted = False
        try:
            while True:
                while not exhausted and len(pending) < max_in_flight:
                    try:
                        item = next(it)
                    except StopIteration:
                        exhausted = True
                        break
                    spec = as_job_spec(item)
                    handle = self.submit(
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
                while True:  # bounded slices: no wait is ever passed an infinite timeout
                    wait_s = min(head_deadline - time.monotonic(), _WAIT_SLICE_S)
                    got = self._wait_any([head] if ordered else pending, max(wait_s, 0.0))
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
                with self._cond:
                    for job_id in pending:
                        self._forget(job_id)


__all__ = [
    "MAX_UNCLAIMED_RESULTS",
    "BadRequestError",
    "ClientClosed",
    "DeadLetterError",
    "ExpiredError",
    "InternalJobError",
    "JobFailed",
    "JobHandle",
    "JobSpec",
    "ScoreResult",
    "ScoringClient",
    "ScoringTimeout",
    "SeqScore",
    "TooLongError",
    "UnsupportedModeError",
    "job_failed",
]
