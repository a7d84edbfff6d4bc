"""The routes around scoring: ``GET /health`` (and ``/health/``), ``GET /v1/models``,
``GET /metrics``.

``/health`` answers 200 while Redis answers (503 ``unavailable`` otherwise) and needs no key:
TRL's ``VLLMClient.check_server`` (``trl/generation/vllm_client.py``) and prime-rl's
``check_health`` poll it, and a Kubernetes readiness probe (no live worker is still ready: the
gateway's requests are what scales the workers from zero). Its body reports the queue:
``{"status": "ok", "queue": q, "worker": bool, "queue_state": {"known", "live_workers",
"consumer_group"}}`` (``known`` false: requests are refused as ``unknown_queue``) and
``redis_server``, what Redis keeps (``{"evicting", "eviction_allowed", "persistent",
"primaries": [...]}``, read every ``redis_check_interval_s``).
``/v1/models`` lists the served model first (TRL reads
``data[0].id`` and sends it back as ``model``; vLLM's ``ModelList``). ``/metrics`` is the
Prometheus text of ``worker.gateway.metrics``.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from worker.gateway.errors import GatewayError
from worker.gateway.http import Json, Router, core_of

router = Router()


@router.get("/health")
@router.get("/health/")
async def health(request: Request) -> Json:
    """200 while Redis answers, with the queue's state."""
    core = core_of(request)
    if not await core.ping():
        raise GatewayError("unavailable", "Redis does not answer")
    worker = await core.live_worker()
    state = await core.queue_state()
    return Json(
        {
            "status": "ok",
            "queue": core.queue,
            "worker": worker is not None,
            "queue_state": state.to_json(),
            "redis_server": core.redis_server,
        }
    )


@router.get("/v1/models")
async def models(request: Request) -> Json:
    """The served model, as vLLM's ``ModelList``."""
    name = await core_of(request).model_name()
    card = {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "scoring-worker",
        "root": name,
        "parent": None,
        "permission": [],
    }
    return Json({"object": "list", "data": [card]})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text."""
    registry = core_of(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
