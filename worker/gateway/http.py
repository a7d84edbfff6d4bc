"""What every route module shares: the ``Router`` each module declares its routes on, the JSON
response (vLLM's and SGLang's clients read ``-Infinity`` and ``NaN`` as Python's ``json`` writes
them), the request's core, the scoring-only checks, and the model field types.

A route is ``@router.post(path)`` over ``async def handler(body: SomeModel, request)``: the body
is parsed and validated as ``SomeModel`` (pydantic, ``model_validate_json``) before the handler
runs, so a malformed body is a 400 before any work; ``@router.get(path)`` handlers take the
request alone. Dispatch is a dictionary lookup (``worker.gateway.app``): no per-request framework
machinery beyond Starlette's ``Request`` and ``Response``. A path may name segments
(``/api/v1/sessions/{session_id}/finish``): such a route is matched by its pattern after the
lookup misses, its segments in ``request.path_params``.
"""

from __future__ import annotations

import json
import re
import secrets
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, Field, StrictInt
from starlette.requests import Request
from starlette.responses import Response

from worker.gateway.core import GatewayCore
from worker.gateway.errors import GatewayError

#: A token id as it travels (int32, >= 0; the worker checks it against its vocabulary).
TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]


Handler = Callable[..., Awaitable[Response]]


@dataclass(frozen=True)
class Route:
    """One route: its method, path, body model (None: no body) and handler."""

    method: str
    path: str
    model: type[BaseModel] | None
    handler: Handler

    @property
    def pattern(self) -> re.Pattern[str] | None:
        """The path's pattern when it names segments (``{name}``: one segment), else None."""
        if "{" not in self.path:
            return None
        parts = re.split(r"\{(\w+)\}", self.path)
        regex = "".join(
            re.escape(p) if i % 2 == 0 else f"(?P<{p}>[^/]+)" for i, p in enumerate(parts)
        )
        return re.compile(regex + "$")


class Router:
    """The routes of one peer format's module."""

    def __init__(self) -> None:
        self.routes: list[Route] = []

    def post(self, path: str) -> Callable[[Handler], Handler]:
        """Declare ``POST path``; the handler's first parameter's annotation is the body model."""

        def add(handler: Handler) -> Handler:
            hints = typing.get_type_hints(handler)
            first = next(iter(hints.values()))
            self.routes.append(Route("POST", path, first, handler))
            return handler

        return add

    def get(self, path: str) -> Callable[[Handler], Handler]:
        """Declare ``GET path`` (the handler takes the request)."""

        def add(handler: Handler) -> Handler:
            self.routes.append(Route("GET", path, None, handler))
            return handler

        return add


class Json(Response):
    """``application/json`` written by ``json.dumps`` (``-Infinity`` and ``NaN`` allowed, as
    vLLM's server writes a masked token's log-prob)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def core_of(request: Request) -> GatewayCore:
    """The gateway core the app holds."""
    core: GatewayCore = request.app.state.core
    return core


def temperature(value: float | None) -> float:
    """The scoring temperature: absent or 0 (greedy: no scaling) is 1.0; else it must be > 0."""
    if value is None or value == 0:
        return 1.0
    if value < 0:
        raise GatewayError("bad_request", f"temperature must be >= 0, got {value}")
    return float(value)


def scoring_only(max_tokens: int | None, what: str = "max_tokens", limit: int = 1) -> None:
    """400 for a request that asks to generate (this gateway only scores)."""
    if max_tokens is not None and max_tokens > limit:
        raise GatewayError(
            "bad_request",
            f"{what}={max_tokens}: this gateway scores prompts and generates nothing; send "
            f"{what} <= {limit} (the answer carries no generated text)",
        )


def request_id(prefix: str) -> str:
    """A response id like vLLM's (``cmpl-<hex>``)."""
    return f"{prefix}-{secrets.token_hex(16)}"
