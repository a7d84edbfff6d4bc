"""The typed error tree.

Every error that can reach a producer carries a stable ``code`` that travels in the
error result of the wire protocol (``docs/protocol.md``). Codes never change meaning.
"""

from __future__ import annotations

ERROR_CODES: tuple[str, ...] = (
    "bad_request",
    "too_long",
    "unsupported_mode",
    "expired",
    "dead_letter",
    "internal",
)


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


class TooLong(ScoringError):
    """A sequence exceeds the model's positions or cannot fit on the device even alone."""

    code = "too_long"


class UnsupportedMode(ScoringError):
    """The requested mode needs a model this worker does not serve."""

    code = "unsupported_mode"


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
    """Invalid configuration, raised at construction time with a clear message."""


class ProtocolError(BadRequest):
    """A payload could not be decoded; ``raw`` keeps (a bounded prefix of) the bytes."""

    def __init__(self, message: str, *, raw: bytes | None = None) -> None:
        super().__init__(message)
        self.raw = raw[:256] if raw is not None else None


_BY_CODE: dict[str, type[ScoringError]] = {
    "bad_request": BadRequest,
    "too_long": TooLong,
    "unsupported_mode": UnsupportedMode,
    "expired": Expired,
    "dead_letter": DeadLetter,
    "internal": InternalError,
}


def error_for_code(code: str, message: str) -> ScoringError:
    """Rebuild the typed error for a wire ``code`` (unknown codes become ``InternalError``)."""
    cls = _BY_CODE.get(code, InternalError)
    err = cls(message)
    if cls is InternalError and code not in _BY_CODE:
        err = InternalError(f"[{code}] {message}")
    return err


class ScoringWarning(UserWarning):
    """Warnings raised by scoring-worker itself (tests turn them into errors)."""
