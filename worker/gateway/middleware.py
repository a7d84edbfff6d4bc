"""Auth, limits and metrics as ASGI middleware, around every route (never inside one).

* ``AuthMiddleware``: with an API key set, a request to any path but ``OPEN_PATHS`` needs the
  key (``presented_key``: ``Authorization: Bearer <key>``, HTTP Basic with the key as the
  password and any user name, so ``http://k:<key>@host/...`` carries it for clients that send no
  header, or ``X-API-Key: <key>``, the Tinker SDK's header), compared in constant time;
  otherwise 401 ``unauthorized`` before the body is read, so nothing is scored. Each 401 is counted
  (``scoring_gateway_unauthorized_total{reason}``) and logged, one line per
  ``UNAUTHORIZED_LOG_S`` at most with the count since the last.
* ``LimitsMiddleware``: a body over ``max_body_bytes`` (by ``Content-Length``, or counted while
  it streams in) gets 413 ``payload_too_large``; more than ``max_concurrent`` requests in flight
  get 503 ``overloaded``.
* ``MetricsMiddleware``: counts requests by route and status, their latency, those in flight,
  and errors by the code an error response names (``x-scoring-error``).

Plain ASGI (no per-request objects beyond the scope): the gateway answers thousands of small
requests a second.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from worker.gateway.config import OPEN_PATHS
from worker.gateway.errors import ERROR_HEADER, error_body
from worker.gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

#: At most one log line about refused keys per this many seconds (with the count since the last).
UNAUTHORIZED_LOG_S = 10.0

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(send: Send, code: str, message: str) -> None:
    """Answer with the error body of ``code`` (``worker.gateway.errors``)."""
    status, body = error_body(code, message)
    headers = [
        (b"content-type", b"application/json"),
        (ERROR_HEADER.encode(), code.encode()),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers") or ():
        if key == name:
            return bytes(value)
    return None


def presented_key(scope: Scope) -> bytes | None:
    """The key a request presents: ``Authorization: Bearer <key>``, the password of
    ``Authorization: Basic`` (any user name; what ``requests`` and ``aiohttp`` send for a URL
    ``http://user:<key>@host/``), or ``X-API-Key: <key>``; None when it presents none."""
    auth = _header(scope, b"authorization")
    if auth:
        scheme, _, value = auth.partition(b" ")
        scheme = scheme.lower()
        if scheme == b"bearer":
            return value.strip()
        if scheme == b"basic":
            try:
                _, _, password = base64.b64decode(value.strip(), validate=True).partition(b":")
            except (binascii.Error, ValueError):
                return b""
            return password
        return b""  # another scheme: a key, but not ours
    return _header(scope, b"x-api-key")


class AuthMiddleware:
    """401 without the right key (when a key is set); 401s counted and logged, rate-limited."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, metrics: GatewayMetrics | None = None
    ) -> None:
        self.app = app
        self._expected = api_key.encode() if api_key else None
        self.metrics = metrics
        self._refused = 0  # 401s since the last log line
        self._logged_at = -1e9  # monotonic

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._expected is None or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = presented_key(scope)
        if given is None or not hmac.compare_digest(given, self._expected):
            reason = "missing" if given is None else "wrong"
            self._note(reason, scope)
            await send_error(
                send,
                "unauthorized",
                f"{reason} API key: send Authorization: Bearer <key>, or the key as the "
                "password of the URL (http://k:<key>@host/...)",
            )
            return
        await self.app(scope, receive, send)

    def _note(self, reason: str, scope: Scope) -> None:
        """Count a 401 and log it (one line per ``UNAUTHORIZED_LOG_S``, with the count)."""
        if self.metrics is not None:
            self.metrics.unauthorized.labels(reason=reason).inc()
        self._refused += 1
        now = time.monotonic()
        if now - self._logged_at < UNAUTHORIZED_LOG_S:
            return
        client = scope.get("client") or ("?", 0)
        log.warning(
            "401 unauthorized: %d request(s) without the right key in the last %.0f s (latest: "
            "%s key, %s %s from %s); a client that sends no header can carry the key in the "
            "URL: http://k:<key>@host:port/...",
            self._refused, min(now - self._logged_at, UNAUTHORIZED_LOG_S), reason,
            scope.get("method", "?"), scope.get("path", "?"), client[0],
        )  # fmt: skip
        self._refused = 0
        self._logged_at = now


class LimitsMiddleware:
    """413 for a body over ``max_body_bytes``; 503 past ``max_concurrent`` in flight."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_concurrent: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_concurrent = max_concurrent
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await send_error(
                send,
                "payload_too_large",
                f"body of {int(length)} bytes is over {self.max_body_bytes}",
            )
            return
        if self.in_flight >= self.max_concurrent:
            await send_error(
                send,
                "overloaded",
                f"{self.in_flight} requests in flight (limit {self.max_concurrent})",
            )
            return
        limit = self.max_body_bytes
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(seen)
            return message

        self.in_flight += 1
        try:
            await self.app(scope, counted, send)
        except BodyTooLarge as exc:
            await send_error(send, "payload_too_large", f"body over {limit} bytes ({exc})")
        finally:
            self.in_flight -= 1


class BodyTooLarge(Exception):
    """A streamed body grew past the limit."""


class MetricsMiddleware:
    """Requests, latency, in flight and errors by route (``routes``: the known paths)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, routes: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes
        self._children: dict[tuple[str, int], tuple[Any, Any]] = {}  # (route, status) -> metrics

    def _of(self, route: str, status: int) -> tuple[Any, Any]:
        """The request counter and latency histogram children (looked up once per pair)."""
        found = self._children.get((route, status))
        if found is None:
            m = self.metrics
            found = (
                m.requests.labels(route=route, status=str(status)),
                m.latency.labels(route=route),
            )
            self._children[(route, status)] = found
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"
        started = time.perf_counter()
        status = 500
        m = self.metrics

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                for key, value in message.get("headers") or ():
                    if key == ERROR_HEADER.encode():
                        m.errors.labels(route=route, code=bytes(value).decode()).inc()
            await send(message)

        m.in_flight.inc()
        try:
            await self.app(scope, receive, watched)
        finally:
            m.in_flight.dec()
            requests, latency = self._of(route, status)
            requests.inc()
            latency.observe(time.perf_counter() - started)
