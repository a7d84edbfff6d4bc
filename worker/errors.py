"""The typed error tree.

Every error that can reach a producer carries a stable ``code`` that travels in the
error result of the wire protocol (``docs/protocol.md``). Codes never change meaning.
``ERROR_TABLE`` lists them: every other list of codes is derived from it.
"""

from __future__ import annotations

from dataclasses import dataclass


class ScoringError(Exception):
    """Base of every error raised by scoring-worker; ``code`` is its wire code."""

    code: str = "internal"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            if code not in ERROR_CODES:
                raise ValueError(f"unknown error code {code!r}; expected one of {ERROR_CODES}")
            self.code = code

    @property
    def message(self) -> str:
        """The human-readable message (no code prefix)."""
        return str(self.args[0]) if self.args else ""

    def to_wire(self) -> dict[str, str]:
        """The ``{code, message}`` map that goes into an error result."""
        return {"code": self.code, "message": self.message}


class BadRequest(ScoringError):
    """The job or sequence is malformed: schema, types, token ids, masks, sizes."""

    code = "bad_request"


class TooLarge(BadRequest):
    """The job's result would be larger than the job's or the worker's byte limit."""

    code = "too_large"


class TooLong(ScoringError):
    """A sequence exceeds the model's positions or cannot fit on the device even alone."""

    code = "too_long"


class UnsupportedMode(ScoringError):
    """The requested mode needs a model this worker does not serve."""

    code = "unsupported_mode"


class ModelNotFound(ScoringError):
    """The adapter or version a job names is not a directory under the worker's roots."""

    code = "model_not_found"


class Expired(ScoringError):
    """The job was still queued after its ``deadline_ms``."""

    code = "expired"


class DeadLetter(ScoringError):
    """The job was delivered too many times (or could not be answered) and was dead-lettered."""

    code = "dead_letter"


class InternalError(ScoringError):
    """An unexpected failure inside the worker; the job may be retried."""

    code = "internal"


class KVCacheRejected(InternalError):
    """The model returned a KV cache despite ``use_cache=False``; the batch was rejected.

    ``kv_output_tensors`` and ``kv_output_bytes`` say how much cache the model returned.
    """

    def __init__(self, message: str, *, kv_output_tensors: int = 0, kv_output_bytes: int = 0):
        super().__init__(message)
        self.kv_output_tensors = kv_output_tensors
        self.kv_output_bytes = kv_output_bytes


class AttentionBackendError(ScoringError):
    """No attention backend in the fallback chain could run the batch."""

    code = "internal"


class ConfigError(ValueError):
    """Invalid configuration, raised at construction time with a clear message.

    ``hint``, when given, says what to do about it (the command line prints it on a second
    line under ``error: <message>``)."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class ProtocolError(BadRequest):
    """A payload could not be decoded; ``raw`` keeps (a bounded prefix of) the bytes."""

    def __init__(self, message: str, *, raw: bytes | None = None) -> None:
        super().__init__(message)
        self.raw = raw[:256] if raw is not None else None


@dataclass(frozen=True)
class ErrorKind:
    """One row of ``ERROR_TABLE``: a wire error code and the classes that carry it."""

    #: The class raised inside the worker; its ``code`` attribute is the wire code.
    error: type[ScoringError]
    #: The name of the ``worker.client`` class a producer catches (a ``JobFailed`` and ``error``).
    job_failed: str

    @property
    def code(self) -> str:
        """The wire code."""
        return self.error.code

    @property
    def meaning(self) -> str:
        """What the code means (the first line of the class docstring)."""
        return (self.error.__doc__ or "").strip().splitlines()[0]


# The declarative table of error codes, one row per wire code, in the order of docs/protocol.md.
# Everything else derives from it: ERROR_CODES, _BY_CODE here, the client's code -> JobFailed map
# (worker.client.errors, which checks its classes against it) and the job outcomes counted in the
# metrics (worker.observability.metrics.JOB_OUTCOMES = ("ok", *ERROR_CODES)).
ERROR_TABLE: tuple[ErrorKind, ...] = (
    ErrorKind(BadRequest, job_failed="BadRequestError"),
    ErrorKind(TooLong, job_failed="TooLongError"),
    ErrorKind(TooLarge, job_failed="TooLargeError"),
    ErrorKind(UnsupportedMode, job_failed="UnsupportedModeError"),
    ErrorKind(ModelNotFound, job_failed="ModelNotFoundError"),  # per-job adapters/versions
    ErrorKind(Expired, job_failed="ExpiredError"),
    ErrorKind(DeadLetter, job_failed="DeadLetterError"),
    ErrorKind(InternalError, job_failed="InternalJobError"),
)
#: Every wire error code; codes never change meaning.
ERROR_CODES: tuple[str, ...] = tuple(kind.code for kind in ERROR_TABLE)
#: Codes a producer raises itself, never carried by a result: ``queue_full`` (Redis refused the
#: job for memory, ``worker.client.QueueFullError``; the gateway answers it 503).
PRODUCER_CODES: tuple[str, ...] = ("queue_full",)
_BY_CODE: dict[str, type[ScoringError]] = {kind.code: kind.error for kind in ERROR_TABLE}
if len(_BY_CODE) != len(ERROR_TABLE):
    raise RuntimeError(f"ERROR_TABLE has a code twice: {ERROR_CODES}")


def error_for_code(code: str, message: str) -> ScoringError:
    """Rebuild the typed error for a wire ``code`` (unknown codes become ``InternalError``)."""
    cls = _BY_CODE.get(code, InternalError)
    err = cls(message)
    if cls is InternalError and code not in _BY_CODE:
        err = InternalError(f"[{code}] {message}")
    return err


class ScoringWarning(UserWarning):
    """Warnings raised by scoring-worker itself (tests turn them into errors)."""
