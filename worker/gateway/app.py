"""The ASGI application: every peer format's routes over one ``GatewayCore``, the error table
for whatever a route raises, auth, limits and metrics as middleware.

``create_app(config, client_factory)`` returns the app to serve (``uvicorn``). Its lifespan
starts the core (its asyncio client and coalescer) and, on shutdown, answers what is in flight
and closes the client. A request is dispatched by one dictionary lookup of ``(method, path)``;
its body is validated as the route's pydantic model (``worker.gateway.http.Router``) and a body
that does not parse or validate is a 400 ``bad_request`` before any work. Errors, whatever
raised them, answer the JSON body of ``worker.gateway.errors``. (No web framework beyond
Starlette's ``Request``/``Response`` in the request path: thousands of one-sample requests a
second is the load this serves.)
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from worker.client.aio import AsyncScoringClient
from worker.gateway import openrlhf, pooling, service, sglang, slime, vllm
from worker.gateway.config import GatewayConfig
from worker.gateway.core import GatewayCore
from worker.gateway.errors import error_body, error_code, error_headers, error_message
from worker.gateway.http import Route
from worker.gateway.metrics import GatewayMetrics
from worker.gateway.middleware import (
    ASGIApp,
    AuthMiddleware,
    LimitsMiddleware,
    MetricsMiddleware,
    Receive,
    Scope,
    Send,
)
from worker.gateway.tinker import routes as tinker
from worker.gateway.tinker.futures import FutureStore

log = logging.getLogger(__name__)

#: One module per peer format, then the service routes.
FORMATS = (openrlhf, slime, vllm, pooling, sglang, tinker, service)
ROUTES: dict[tuple[str, str], Route] = {
    (r.method, r.path): r for m in FORMATS for r in m.router.routes if r.pattern is None
}
#: Routes whose paths name segments, matched in order after the lookup misses.
TEMPLATES: list[tuple[Route, re.Pattern[str]]] = [
    (r, r.pattern) for m in FORMATS for r in m.router.routes if r.pattern is not None
]
PATHS = frozenset(path for _, path in ROUTES)


def error_response(code: str, message: str) -> Response:
    """The error answer of ``code`` (``worker.gateway.errors``)."""
    status, body = error_body(code, message)
    return Response(body, status_code=status, headers=error_headers(code))


def invalid_body(exc: ValidationError | ValueError) -> Response:
    """400 naming the first few fields that failed validation."""
    errors: Any = exc.errors() if isinstance(exc, ValidationError) else []
    parts = []
    for e in errors[:5]:
        where = ".".join(str(x) for x in e.get("loc", ()))
        parts.append(f"{where or 'body'}: {e.get('msg', 'invalid')}")
    return error_response("bad_request", "invalid request body: " + "; ".join(parts or [str(exc)]))


def _templated(scope: Scope) -> Route | None:
    """The route whose pattern matches (its segments into ``scope["path_params"]``)."""
    for route, pattern in TEMPLATES:
        if route.method == scope["method"] and (match := pattern.match(scope["path"])):
            scope["path_params"] = match.groupdict()
            return route
    return None


class GatewayApp:
    """The routes' dispatcher and the lifespan (``scope["app"]`` is this object, so
    ``request.app.state.core`` reaches the core)."""

    def __init__(self, core: GatewayCore) -> None:
        config = core.config
        futures = FutureStore(config.tinker_max_pending, config.tinker_result_ttl_s)
        self.state = SimpleNamespace(core=core, tinker_futures=futures)
        self.core = core

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        scope["app"] = self
        request = Request(scope, receive)
        response = await self._answer(scope, request)
        await response(scope, receive, send)

    async def _answer(self, scope: Scope, request: Request) -> Response:
        route = ROUTES.get((scope["method"], scope["path"])) or _templated(scope)
        if route is None:
            if scope["path"] in PATHS:
                return error_response(
                    "bad_request", f"{scope['method']} is not served on {scope['path']}"
                )
            return error_response("not_found", f"no route {scope['method']} {scope['path']}")
        try:
            if route.model is None:
                return await route.handler(request)
            try:
                body = route.model.model_validate_json(await request.body())
            except ValidationError as exc:
                return invalid_body(exc)
            return await route.handler(body, request)
        except Exception as exc:  # every error answers its code's status and JSON body
            code = error_code(exc)
            if code == "internal":
                log.error("%s %s failed: %s", scope["method"], scope["path"], exc, exc_info=exc)
            return error_response(code, error_message(exc))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.core.start()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.state.tinker_futures.close()
                await self.core.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def create_app(
    config: GatewayConfig,
    client_factory: Callable[[], AsyncScoringClient],
    metrics: GatewayMetrics | None = None,
) -> ASGIApp:
    """The gateway as an ASGI app (see the module docstring); ``app.core`` is its core."""
    metrics = metrics or GatewayMetrics()
    core = GatewayCore(config, client_factory, metrics)
    app = GatewayApp(core)
    limited = LimitsMiddleware(
        AuthMiddleware(app, config.api_key, metrics), config.max_body_bytes, config.max_concurrent
    )
    wrapped = MetricsMiddleware(limited, metrics, PATHS)
    wrapped.core = core  # type: ignore[attr-defined]  # tests and benchmarks reach the core
    return wrapped
