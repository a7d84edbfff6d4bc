"""The ASGI application: every peer format's routes over one ``GatewayCore``, the error table
as exception handlers, auth, limits and metrics as middleware.

``create_app(config, client_factory)`` returns the app to serve (``uvicorn``); the lifespan
starts the core (its asyncio client and coalescer) and, on shutdown, answers what is in flight
and closes the client. Errors, whatever raised them, answer the JSON body of
``worker.gateway.errors``: a body that does not parse or validate is a 400 ``bad_request``
before any work.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from redis import RedisError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from worker.client.aio import AsyncScoringClient
from worker.errors import ScoringError
from worker.gateway import openrlhf, pooling, service, sglang, slime, vllm
from worker.gateway.config import GatewayConfig
from worker.gateway.core import GatewayCore
from worker.gateway.errors import (
    GatewayError,
    error_body,
    error_code,
    error_headers,
    error_message,
)
from worker.gateway.metrics import GatewayMetrics
from worker.gateway.middleware import ASGIApp, AuthMiddleware, LimitsMiddleware, MetricsMiddleware

log = logging.getLogger(__name__)

#: One module per peer format, then the service routes.
FORMATS = (openrlhf, slime, vllm, pooling, sglang, service)
ROUTES = frozenset(r for m in FORMATS for r in m.ROUTES)


def _error(code: str, message: str) -> Response:
    status, body = error_body(code, message)
    return Response(body, status_code=status, headers=error_headers(code))


async def _on_error(request: Request, exc: Exception) -> Response:
    code = error_code(exc)
    message = error_message(exc)
    if code == "internal":
        log.error("%s %s failed: %s", request.method, request.url.path, message, exc_info=exc)
    return _error(code, message)


async def _on_invalid(request: Request, exc: Exception) -> Response:
    errors: Any = exc.errors() if isinstance(exc, RequestValidationError) else []
    parts = []
    for e in errors[:5]:
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{where or 'body'}: {e.get('msg', 'invalid')}")
    return _error("bad_request", "invalid request body: " + "; ".join(parts or ["malformed"]))


async def _on_http(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    code = {404: "not_found", 405: "bad_request"}.get(status, "internal")
    return _error(code, f"{request.method} {request.url.path}: {getattr(exc, 'detail', exc)}")


def create_app(
    config: GatewayConfig,
    client_factory: Callable[[], AsyncScoringClient],
    metrics: GatewayMetrics | None = None,
) -> ASGIApp:
    """The gateway as an ASGI app (see the module docstring)."""
    metrics = metrics or GatewayMetrics()
    core = GatewayCore(config, client_factory, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await core.start()
        try:
            yield
        finally:
            await core.close()

    app = FastAPI(
        title="scoring-worker gateway",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.core = core
    for module in FORMATS:
        app.include_router(module.router)
    app.add_exception_handler(RequestValidationError, _on_invalid)
    app.add_exception_handler(HTTPException, _on_http)
    for expected in (GatewayError, ScoringError, TimeoutError, RedisError, ValueError):
        app.add_exception_handler(expected, _on_error)  # answered, not re-raised
    app.add_exception_handler(Exception, _on_error)  # the unexpected: 500, logged
    limited = LimitsMiddleware(
        AuthMiddleware(app, config.api_key), config.max_body_bytes, config.max_concurrent
    )
    wrapped = MetricsMiddleware(limited, metrics, ROUTES)
    wrapped.core = core  # type: ignore[attr-defined]  # tests and benchmarks reach the core
    return wrapped
