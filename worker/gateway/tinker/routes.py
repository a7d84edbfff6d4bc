"""The Tinker sampling API (``/api/v1/...``) for teacher and reference log-probs: the unmodified
``tinker`` SDK (0.38.0) works against the gateway with ``ServiceClient(base_url=URL,
api_key=KEY)`` (or ``TINKER_BASE_URL``), over plain http.

The peer's client: ``tinker/lib/internal_client_holder.py`` (``client/config``, then
``create_session``, a heartbeat every 10 s), ``tinker/resources/service.py``
(``create_sampling_session``), ``tinker/lib/public_interfaces/sampling_client.py``
(``asample``, then ``tinker/lib/api_future_impl.py`` long-polls ``retrieve_future``; a
``SamplingClient`` made from a ``model_path`` alone first reads ``GET /api/v1/samplers/{id}``),
``tinker/lib/public_interfaces/service_client.py`` (``close()`` posts
``sessions/{id}/finish``). The key travels as ``X-API-Key`` and the SDK sends only keys that
start ``tml-`` (``tinker/lib/_auth_token_provider.py``): start the gateway with such a key.
``client/dynamic_config`` is not served (404: the SDK keeps its defaults); ``telemetry`` is
accepted and dropped.

Weights: a sampling client's ``model_path`` ``tinker://NAME`` names what a request's ``model``
names on the other routes (``GatewayCore.weights``: ``tinker://adapter:NAME``,
``tinker://version:NAME``, any other name an adapter); a ``base_model`` must be the served
model's name (``--model-name``), else 404 ``model_not_found`` when the client is created.
Sessions hold no state here: a sampling session's id carries its weights, so any gateway
replica can serve it; the futures live in the gateway that took the ``asample``
(``worker.gateway.tinker.futures``). What a sample scores and answers:
``worker.gateway.tinker.plan``; image chunks: ``worker.gateway.tinker.images``; the protobuf
answer: ``worker.gateway.tinker.wire``.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictStr
from starlette.requests import Request
from starlette.responses import Response

from worker.gateway.core import GatewayCore
from worker.gateway.errors import GatewayError
from worker.gateway.http import Json, Router, core_of
from worker.gateway.tinker.futures import FutureStore, outcome_of
from worker.gateway.tinker.plan import MAX_SAMPLES, SamplePlan
from worker.gateway.tinker.wire import SampleRequest, encode_sample_response

router = Router()

PREFIX = "tinker://"
ROUTE = "/api/v1/asample"
#: How long ``retrieve_future`` holds a poll before ``try_again`` (the SDK waits 45 s).
LONG_POLL_S = 20.0
PROTOBUF = "application/x-protobuf"


class AnyBody(BaseModel):
    """A body whose fields this gateway does not need (sessions, config, finish)."""

    model_config = ConfigDict(extra="ignore")


class CreateSamplingSessionRequest(BaseModel):
    """``tinker.types.CreateSamplingSessionRequest``."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    session_id: StrictStr | None = None
    sampling_session_seq_id: int | None = None
    base_model: StrictStr | None = None
    model_path: StrictStr | None = None


class FutureRetrieveRequest(BaseModel):
    """``tinker.types.FutureRetrieveRequest``."""

    model_config = ConfigDict(extra="ignore")

    request_id: StrictStr
    allow_metadata_only: bool = False


def futures_of(request: Request) -> FutureStore:
    """The app's futures."""
    futures: FutureStore = request.app.state.tinker_futures
    return futures


# -- sampling sessions: the id carries the weights


def session_id(base_model: str | None, model_path: str | None) -> str:
    """A sampling session id: random, then the weights it samples (base64url JSON)."""
    weights = json.dumps({"base_model": base_model, "model_path": model_path}).encode()
    return f"ss-{secrets.token_hex(8)}.{base64.urlsafe_b64encode(weights).decode().rstrip('=')}"


def session_weights(sampling_session_id: str) -> tuple[str | None, str | None]:
    """``(base_model, model_path)`` of a sampling session id (a user error when malformed)."""
    try:
        tail = sampling_session_id.split(".", 1)[1]
        data = json.loads(base64.urlsafe_b64decode(tail + "=" * (-len(tail) % 4)))
        base, path = data["base_model"], data["model_path"]
    except (IndexError, KeyError, TypeError, ValueError, binascii.Error):
        raise GatewayError(
            "bad_request", f"sampling session {sampling_session_id!r} was not made here"
        ) from None
    if not all(v is None or isinstance(v, str) for v in (base, path)):
        raise GatewayError("bad_request", f"sampling session {sampling_session_id!r} is malformed")
    return base, path


async def weights_of(
    core: GatewayCore, base_model: str | None, model_path: str | None
) -> tuple[str | None, str | None]:
    """``(adapter, version)`` a sampling client's ``model_path`` / ``base_model`` name."""
    if model_path:
        if not model_path.startswith(PREFIX):
            raise GatewayError("bad_request", f"model_path must start with {PREFIX}")
        return await core.weights(model_path[len(PREFIX) :] or None)
    served = await core.model_name()
    if base_model is None or base_model == served:
        return None, None
    raise GatewayError(
        "model_not_found",
        f"base_model {base_model!r}: this gateway serves {served!r} (start it with "
        f"--model-name {base_model!r} if that is the model; tinker://NAME for adapters)",
    )


# -- routes


@router.post("/api/v1/client/config")
async def client_config(body: AnyBody, request: Request) -> Json:
    """The SDK's feature flags: API keys (no JWT exchange), one ``retrieve_future`` poll per
    sample, httpx's own transport."""
    return Json(
        {
            "pjwt_auth_enabled": False,
            "sample_use_retrieve_futures": False,
            "sample_join_sampling_session": False,
            "use_pyqwest_transport": False,
            "sample_max_concurrent_requests": futures_of(request).max_pending,
        }
    )


@router.post("/api/v1/create_session")
async def create_session(body: AnyBody, request: Request) -> Json:
    """A session id (sessions hold nothing here)."""
    return Json({"type": "create_session", "session_id": f"session-{secrets.token_hex(12)}"})


@router.post("/api/v1/session_heartbeat")
async def session_heartbeat(body: AnyBody, request: Request) -> Json:
    """Always alive."""
    return Json({"type": "session_heartbeat"})


@router.post("/api/v1/telemetry")
async def telemetry(body: AnyBody, request: Request) -> Json:
    """The SDK's telemetry batches: accepted, not kept."""
    return Json({"status": "accepted"})


@router.post("/api/v1/sessions/{session_id}/finish")
async def finish_session(body: AnyBody, request: Request) -> Json:
    """``ServiceClient.close()``: nothing to release."""
    return Json(None)


@router.post("/api/v1/create_sampling_session")
async def create_sampling_session(body: CreateSamplingSessionRequest, request: Request) -> Json:
    """A sampling session on the weights ``model_path`` or ``base_model`` names (checked)."""
    if body.model_path is None and body.base_model is None:
        raise GatewayError("bad_request", "give model_path or base_model")
    await weights_of(core_of(request), body.base_model, body.model_path)
    return Json(
        {
            "type": "create_sampling_session",
            "sampling_session_id": session_id(body.base_model, body.model_path),
        }
    )


@router.get("/api/v1/samplers/{sampler_id}")
async def get_sampler(request: Request) -> Json:
    """``GetSamplerResponse``: the sampler's base model and model path."""
    sampler_id = request.path_params["sampler_id"]
    base, path = session_weights(sampler_id)
    base = base or await core_of(request).model_name()
    return Json({"sampler_id": sampler_id, "base_model": base, "model_path": path})


@router.post(ROUTE)
async def asample(body: SampleRequest, request: Request) -> Json:
    """Start the job of one sample request; its future's id and one id per sample at once."""
    core, futures = core_of(request), futures_of(request)
    await core.admit()  # the queue rule: a queue nobody serves is refused here, not in a future
    sid, seq = body.sampling_session_id, body.seq_id
    rid = f"{sid}/{seq}" if sid is not None and seq is not None else f"s-{secrets.token_hex(12)}"
    answer = {
        "request_id": rid,
        "sample_sequence_ids": [f"{rid}:{i}" for i in range(min(body.num_samples, MAX_SAMPLES))],
    }
    try:
        plan = SamplePlan.of(body, core.config.image_token_id)
        base, path = session_weights(sid) if sid is not None else (body.base_model, body.model_path)
    except GatewayError as exc:  # the user's error, answered through the future
        futures.answer(rid, outcome_of(exc))
        return Json(answer)

    async def run() -> bytes:
        adapter, version = await weights_of(core, base, path)
        score = None
        if plan.start:
            key = plan.key(adapter, version)
            (score,) = await core.score(ROUTE, [plan.seq()], key, plan.images or None)
        return encode_sample_response(plan.answer(score))

    futures.submit(rid, run)
    return Json(answer)


@router.post("/api/v1/cancel_future")
async def cancel_future(body: FutureRetrieveRequest, request: Request) -> Json:
    """A future the SDK abandoned (its ``result(timeout)`` ran out): dropped."""
    futures_of(request).cancel(body.request_id)
    return Json(None)


@router.post("/api/v1/retrieve_future")
async def retrieve_future(body: FutureRetrieveRequest, request: Request) -> Response:
    """The future's answer: protobuf, an ``{"error", "category"}`` body, or ``try_again``
    after ``LONG_POLL_S``; 410 for an id not held."""
    outcome = await futures_of(request).wait(body.request_id, LONG_POLL_S)
    if outcome is None:
        return Json({"type": "try_again", "request_id": body.request_id, "queue_state": "active"})
    if outcome.body is not None:
        return Response(outcome.body, media_type=PROTOBUF)
    reply: dict[str, Any] = {"error": outcome.error, "category": outcome.category}
    return Json(reply)
