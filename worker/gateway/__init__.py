"""The HTTP gateway: the reward and log-prob APIs RL trainers already call, in front of a queue
(``scoring-worker gateway``; docs/integrations.md).

One module per peer format, each with request/response models that mirror the peer's JSON and a
docstring naming the peer's client file it answers: ``openrlhf`` (``/get_reward``), ``slime``
(``/reward``), ``vllm`` (``/v1/completions``, ``/inference/v1/generate``), ``pooling``
(``/classify``, ``/v1/classify``), ``sglang`` (``/generate``), ``tinker/`` (a sub-package: the
Tinker SDK's ``/api/v1/...``),
``service`` (``/health``, ``/v1/models``, ``/metrics``). Below them: ``core`` (requests into
jobs on the asyncio client, coalesced by ``worker.client.coalesce``), ``logprobs`` (vLLM's and
SGLang's prompt log-prob entries), ``http`` (what the routes share), ``errors`` (the code -> HTTP
status table), ``middleware`` (auth, limits, metrics), ``metrics``, ``config``, ``app`` (the
ASGI app: dispatch, lifespan, errors).

Imports the client side only (never torch, the worker's streams, scorer, executor or daemon).
"""

from __future__ import annotations

from worker.gateway.config import GatewayConfig

__all__ = ["GatewayConfig"]
