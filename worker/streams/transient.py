"""Which Redis errors are passing (retry later) and which mean the stream or group is gone.

A write the server refuses for a while (memory full, a replica being promoted, a cluster
failing over) is retried with the entry held, never treated as a bad reply stream. redis-py maps
most such errors to exception classes and strips their code from the message; the helpers here
look at the class as well as at the code, and put the code back for logs and error results.
"""

from __future__ import annotations

import redis

# Errors a Redis server answers while it cannot take writes for a while (memory full, a
# replica being promoted, a script running long, a cluster resharding or failing over). A
# write that got one is retried later, never treated as a bad reply stream.
TRANSIENT_ERRORS = ("OOM", "READONLY", "BUSY", "TRYAGAIN", "CLUSTERDOWN", "LOADING",
                    "MASTERDOWN", "NOREPLICAS", "MOVED", "ASK", "CONNECTION",
                    "TIMEOUT")  # fmt: skip


class TransientRedisError(redis.ConnectionError):
    """A write the server refused for now (see :data:`TRANSIENT_ERRORS`); retried with backoff
    like a lost connection."""


_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    redis.ConnectionError,  # BusyLoadingError (LOADING) is one
    redis.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,  # MasterDownError is one
    redis.exceptions.AskError,  # MovedError is one
)


_CODES: tuple[tuple[type[BaseException], str], ...] = (
    (redis.exceptions.OutOfMemoryError, "OOM"),
    (redis.exceptions.ReadOnlyError, "READONLY"),
    (redis.exceptions.BusyLoadingError, "LOADING"),
    (redis.exceptions.TryAgainError, "TRYAGAIN"),
    (redis.exceptions.MasterDownError, "MASTERDOWN"),
    (redis.exceptions.ClusterDownError, "CLUSTERDOWN"),
    (redis.exceptions.MovedError, "MOVED"),
    (redis.exceptions.AskError, "ASK"),
    (redis.ConnectionError, "CONNECTION"),
    (redis.TimeoutError, "TIMEOUT"),
)


def error_text(error: BaseException) -> str:
    """``str(error)`` with the Redis error code put back where redis-py took it off."""
    for cls, code in _CODES:
        if isinstance(error, cls):
            return f"{code} {error}"
    return str(error)


def is_transient(error: BaseException | str) -> bool:
    """True when ``error`` (an exception or a Redis error string, as a script's ``pcall``
    returns it) is one to retry later. redis-py strips the code from the messages of the errors
    it maps to a class, hence the class check."""
    if isinstance(error, BaseException):
        if isinstance(error, _TRANSIENT_TYPES):
            return True
        if not isinstance(error, redis.ResponseError):
            return False
    code = str(error).lstrip("-").split(" ", 1)[0].upper()
    return code in TRANSIENT_ERRORS


def is_nogroup(exc: BaseException) -> bool:
    """True for the error Redis raises when the stream or group is gone (e.g. after a flush)."""
    if not isinstance(exc, redis.ResponseError):
        return False
    msg = str(exc)
    # a blocked XREADGROUP whose stream is deleted gets "UNBLOCKED the stream key no longer exists"
    return msg.startswith("NOGROUP") or (msg.startswith("UNBLOCKED") and "no longer" in msg)


__all__ = ["TRANSIENT_ERRORS", "TransientRedisError", "error_text", "is_nogroup", "is_transient"]
