"""What a producer catches: ``JobFailed`` and its subclass per wire error code, ``QueueFullError``
(Redis refused the job for memory), ``ScoringTimeout``, ``UnknownQueueError`` and
``ClientClosed``.

Each ``JobFailed`` subclass is also the ``worker.errors`` class of its code, so
``except worker.errors.TooLong`` catches ``TooLongError``. The code -> class map is built from
``worker.errors.ERROR_TABLE``, and importing this module fails if a row has no class here or a
class does not carry its row's code.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import redis

from worker import errors
from worker.protocol import Result


class JobFailed(errors.ScoringError):
    """A job came back with an error result, or was refused before it was sent (``sent`` False:
    the client's own checks); ``code``, ``message``, ``job_id`` say which and why."""

    def __init__(
        self,
        job_id: str,
        message: str,
        *,
        info: Mapping[str, Any] | None = None,
        meta: Any = None,
        sent: bool = True,
    ) -> None:
        what = "failed" if sent else "was not sent"
        super().__init__(f"job {job_id} {what} [{self.code}]: {message}")
        self.job_id = job_id
        self.reason = message
        self.info = dict(info or {})
        self.meta = meta
        self.sent = sent


class BadRequestError(JobFailed, errors.BadRequest):
    """The job is malformed (``bad_request``): the worker rejected it, or the client's own
    checks did before sending it (``sent`` False)."""


@contextmanager
def client_checks(job_id: str, meta: Any = None) -> Iterator[None]:
    """Turn the client's own input checks (``worker.errors.BadRequest``, ``ProtocolError``) into
    ``BadRequestError`` for ``job_id``: one error tree for producers, whether the worker or the
    client refused the job."""
    try:
        yield
    except JobFailed:
        raise
    except errors.BadRequest as exc:
        raise BadRequestError(job_id, exc.message, meta=meta, sent=False) from exc


class TooLongError(JobFailed, errors.TooLong):
    """A sequence is longer than the worker's model accepts (``too_long``)."""


class TooLargeError(JobFailed, errors.TooLarge):
    """The job's result would exceed the job's or the worker's byte limit (``too_large``);
    ``except worker.errors.BadRequest`` catches it too."""


class UnsupportedModeError(JobFailed, errors.UnsupportedMode):
    """The worker does not serve the requested mode (``unsupported_mode``)."""


class ModelNotFoundError(JobFailed, errors.ModelNotFound):
    """No adapter or version of that name under the worker's roots (``model_not_found``)."""


class ExpiredError(JobFailed, errors.Expired):
    """The job was still queued after its deadline (``expired``)."""


class DeadLetterError(JobFailed, errors.DeadLetter):
    """The job was dead-lettered after too many deliveries (``dead_letter``)."""


class InternalJobError(JobFailed, errors.InternalError):
    """The worker failed unexpectedly on this job (``internal`` or an unknown code)."""


class QueueFullError(JobFailed):
    """Redis refused the job for memory (``OOM command not allowed when used memory >
    'maxmemory'``: a full server under ``noeviction``); nothing of it was written (``sent``
    False): submit it again once memory frees. From ``score_many``: ``written`` jobs of the
    call went in before it (the workers score each), ``in_flight`` the ids of those whose
    results had not been handed out when it stopped (forgotten with it). Its code is the one
    producer-side code (``worker.errors.PRODUCER_CODES``), never in a result."""

    code = "queue_full"

    def __init__(
        self,
        job_id: str,
        message: str,
        *,
        meta: Any = None,
        written: int = 0,
        in_flight: tuple[str, ...] = (),
    ) -> None:
        super().__init__(job_id, message, meta=meta, sent=False)
        self.written = written
        self.in_flight = in_flight

    @classmethod
    def refused(cls, job_id: str, exc: BaseException) -> QueueFullError:
        """The error of a job whose ``XADD`` Redis refused with ``exc`` (``OOM ...``)."""
        return cls(
            job_id,
            f"Redis refused it for memory (OOM {str(exc).removeprefix('OOM ')}): nothing of it "
            "was written; submit it again once memory frees (docs/guarantees.md)",
        )

    def counted(self, written: int, in_flight: tuple[str, ...]) -> QueueFullError:
        """This error for a ``score_many`` call that wrote ``written`` jobs before it."""
        out = QueueFullError(
            self.job_id,
            f"{self.reason}; score_many stopped: {written} of its jobs were written before it "
            f"({len(in_flight)} not answered yet)",
            meta=self.meta,
            written=written,
            in_flight=in_flight,
        )
        out.__cause__ = self.__cause__
        return out


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing a write for memory (``OOM ...``)."""
    return isinstance(exc, redis.exceptions.OutOfMemoryError) or (
        isinstance(exc, redis.ResponseError) and str(exc).startswith("OOM")
    )


def _failed_class(kind: errors.ErrorKind) -> type[JobFailed]:
    """The class named by ``kind.job_failed``, checked to be a ``JobFailed`` and ``kind.error``."""
    cls = globals().get(kind.job_failed)
    if not (isinstance(cls, type) and issubclass(cls, JobFailed) and issubclass(cls, kind.error)):
        raise RuntimeError(
            f"worker.errors.ERROR_TABLE names {kind.job_failed!r} for {kind.code!r}, but "
            f"worker.client.errors has no such JobFailed subclass of {kind.error.__name__}"
        )
    return cls


#: The ``JobFailed`` subclass of each wire error code, from ``worker.errors.ERROR_TABLE``.
FAILED_BY_CODE: dict[str, type[JobFailed]] = {
    kind.code: _failed_class(kind) for kind in errors.ERROR_TABLE
}


def job_failed(result: Result) -> JobFailed:
    """The typed exception for an error result (unknown codes become ``InternalJobError``)."""
    err = result.error or {}
    code = str(err.get("code", "internal"))
    message = str(err.get("message", ""))
    cls = FAILED_BY_CODE.get(code)
    if cls is None:
        cls, message = InternalJobError, f"[{code}] {message}"
    return cls(result.id, message, info=result.info, meta=result.meta)


class ScoringTimeout(TimeoutError):
    """No result arrived in time; ``job_id`` and ``waited_s`` say for which job and how long."""

    def __init__(
        self, job_id: str, waited_s: float, reply_stream: str = "", hint: str | None = None
    ) -> None:
        where = f" on {reply_stream}" if reply_stream else ""
        hint = hint or "is a worker serving this queue? see `scoring-worker info`"
        super().__init__(
            f"no result for job {job_id} after waiting {waited_s:.1f} s{where} ({hint})"
        )
        self.job_id = job_id
        self.waited_s = waited_s


class UnknownQueueError(errors.ConfigError):
    """A submit refused before anything was written: no worker serves the queue and none ever
    did (no consumer group on its streams), a typo or a fleet not started yet; ``queue`` names
    it, ``queues`` the queues the server holds (None: the server would not list them)."""

    code = "unknown_queue"

    def __init__(self, queue: str, queues: list[str] | None) -> None:
        there = (
            "the server lists none"
            if queues == []
            else "queues there: " + ", ".join(queues)
            if queues
            else "'scoring-worker info --list' lists the queues there are"
        )
        super().__init__(
            f"no worker serves queue {queue!r} and none ever did (no consumer group on its "
            f"streams): nothing was submitted ({there}); wait_for_unknown_queue=True waits anyway",
            hint=f"check the queue name, or start a worker (scoring-worker serve --queue {queue}); "
            "for a fleet that creates its group on first start, wait anyway "
            "(enqueue --wait-for-workers SECONDS, gateway --allow-unknown-queue)",
        )
        self.queue = queue
        self.queues = queues


class ClientClosed(RuntimeError):
    """The client was closed while a caller waited on it."""
