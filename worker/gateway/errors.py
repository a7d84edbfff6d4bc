"""One table from error code to HTTP status, and the JSON body every error answers with.

Codes are the wire codes of ``worker.errors.ERROR_TABLE`` (what a job's error result carries,
raised on the producer side as ``JobFailed`` subclasses or, for input the client refuses before
sending, as ``worker.errors.BadRequest``: both carry ``code``) plus the gateway's own
(``unauthorized``, ``payload_too_large``, ``overloaded``, ``timeout``, ``unavailable``; the
Tinker routes' ``rate_limited`` and ``result_gone``) and the client's refusal of a queue nobody
serves (``unknown_queue``, ``UnknownQueueError``) or of a job Redis has no memory for
(``queue_full``, ``QueueFullError``: answered with ``Retry-After``). The body, whatever the route::

    {"error": {"code": "<code>", "message": "<why>", "status": <http status>}}

and the ``x-scoring-error`` header names the code (the metrics count errors by it).
"""

from __future__ import annotations

import json
from typing import Any

#: The declarative table of HTTP statuses, by error code (docs/integrations.md lists it).
HTTP_STATUS: dict[str, int] = {
    "bad_request": 400,  # malformed body or input (also before any work)
    "unsupported_mode": 400,  # e.g. a reward route on a queue whose workers serve no reward model
    "unauthorized": 401,  # missing or wrong key (Bearer, Basic password or X-API-Key)
    "not_found": 404,  # no such route
    "model_not_found": 404,  # the model / adapter / version names no weights
    "result_gone": 410,  # a Tinker future this gateway does not hold (expired): submit again
    "payload_too_large": 413,  # the body is over --max-body-bytes
    "too_long": 413,  # a sequence is over the model's positions
    "too_large": 413,  # the job's result would be over its or the worker's byte limit
    "rate_limited": 429,  # too many Tinker samples pending (the SDK backs off and resends)
    "internal": 500,  # the worker failed on the job
    "dead_letter": 500,  # workers died on the job max_deliveries times
    "unknown_queue": 503,  # no worker serves the queue and none ever did (no consumer group)
    "overloaded": 503,  # more requests in flight than --max-concurrent
    "queue_full": 503,  # Redis refused the job for memory (noeviction at maxmemory): retry later
    "unavailable": 503,  # Redis cannot be reached
    "expired": 504,  # still queued at its deadline
    "timeout": 504,  # no result within --timeout-s
}
ERROR_HEADER = "x-scoring-error"
#: Seconds a client is told to wait (``Retry-After``) before sending again, by error code.
RETRY_AFTER_S: dict[str, int] = {"queue_full": 10}


class GatewayError(Exception):
    """An error the gateway answers itself; ``code`` is a key of ``HTTP_STATUS``."""

    def __init__(self, code: str, message: str) -> None:
        if code not in HTTP_STATUS:
            raise ValueError(f"unknown gateway error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message


def error_code(exc: BaseException) -> str:
    """The code of any exception a route may raise (``internal`` for the unexpected)."""
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code in HTTP_STATUS:
        return code
    if isinstance(exc, TimeoutError):  # ScoringTimeout
        return "timeout"
    if type(exc).__module__.startswith("redis") and "Connection" in type(exc).__name__:
        return "unavailable"
    return "internal"


def error_message(exc: BaseException) -> str:
    """The human-readable reason (a ``JobFailed`` keeps the worker's own message)."""
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str) and reason:
        return reason
    message = getattr(exc, "message", None)
    return message if isinstance(message, str) and message else str(exc) or type(exc).__name__


def error_body(code: str, message: str) -> tuple[int, bytes]:
    """The status and JSON body of an error with ``code``."""
    status = HTTP_STATUS.get(code, 500)
    body = {"error": {"code": code, "message": message, "status": status}}
    return status, json.dumps(body).encode()


def error_headers(code: str) -> dict[str, str]:
    """The headers of an error response (content type, the code, ``Retry-After`` where the
    code has one)."""
    headers = {"content-type": "application/json", ERROR_HEADER: code}
    if code in RETRY_AFTER_S:
        headers["retry-after"] = str(RETRY_AFTER_S[code])
    return headers


def describe(exc: BaseException) -> dict[str, Any]:
    """``{code, message}`` of ``exc`` (for logs)."""
    return {"code": error_code(exc), "message": error_message(exc)}
