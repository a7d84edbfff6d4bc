"""vLLM's (and SGLang's) classification route for reward models: ``POST /classify`` and
``POST /v1/classify``.

The peer's format: vLLM's ``ClassificationRequest`` / ``ClassificationResponse``
(``vllm/entrypoints/pooling/classify/protocol.py``, now
``vllm/frontend/entrypoints/pooling/classify/protocol.py``): ``{"model", "input": str | [str] |
[ids] | [[ids]], "use_activation"}`` or the chat form ``{"model", "messages"}``, answered
``{"id", "object": "list", "created", "model", "data": [{"index", "label", "probs",
"num_classes"}], "usage": {"prompt_tokens", "total_tokens", "completion_tokens"}}``. Code
written against a vLLM reward model reads ``data[i].probs``.

``probs`` are the reward head's outputs: raw scores with ``use_activation: false``, else (vLLM's
default) the sigmoid of a one-output head, the softmax of several. Strings are scored as
``text`` (the reward model's tokenizer, as given, no special tokens added: vLLM would add them,
so put a BOS in the string when the model wants one), token ids as they are (at least 2
tokens), ``messages`` with the reward model's chat template. ``label`` is ``LABEL_<argmax>``,
or the head's label names when the workers report them (``reward_objectives``).
"""

from __future__ import annotations

import math
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictStr
from starlette.requests import Request

from worker.client.coalesce import BatchKey
from worker.client.results import SeqScore
from worker.gateway.errors import GatewayError
from worker.gateway.http import Json, Router, TokenId, core_of, request_id

router = Router()


class ClassifyRequest(BaseModel):
    """vLLM's classification request (completion or chat form), the fields that matter."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    input: list[list[TokenId]] | list[TokenId] | StrictStr | list[StrictStr] | None = None
    messages: list[dict[str, Any]] | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None


def sequences(body: ClassifyRequest) -> list[dict[str, Any]]:
    """The sequence maps of the request, in order."""
    if body.truncate_prompt_tokens is not None:
        raise GatewayError("bad_request", "truncate_prompt_tokens is not served: truncate first")
    if (body.input is None) == (body.messages is None):
        raise GatewayError("bad_request", "give exactly one of input and messages")
    if body.messages is not None:
        return [{"messages": body.messages}]
    items: Any = body.input
    if isinstance(items, str):
        return [{"text": items}]
    if items and isinstance(items[0], int):
        items = [items]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            out.append({"text": item})
        elif len(item) < 2:
            raise GatewayError("bad_request", f"input {i} has {len(item)} tokens: at least 2")
        else:
            out.append({"tokens": list(item), "prompt_len": 1})
    return out


def probs(score: SeqScore, activate: bool) -> list[float]:
    """The head's outputs (every objective of a multi-objective head), activated or raw."""
    if score.rewards is not None:
        raw = [float(x) for x in score.rewards]
    else:
        raw = [float(score.reward) if score.reward is not None else float("nan")]
    if not activate:
        return raw
    if len(raw) == 1:
        return [1.0 / (1.0 + math.exp(-raw[0])) if raw[0] == raw[0] else raw[0]]
    top = max(raw)
    exp = [math.exp(x - top) for x in raw]
    total = sum(exp)
    return [e / total for e in exp]


async def _classify(body: ClassifyRequest, request: Request, route: str) -> Json:
    core = core_of(request)
    adapter, version = await core.weights(body.model)
    seqs = sequences(body)
    key = BatchKey(mode="reward", adapter=adapter, version=version)
    scores = await core.score(route, seqs, key)
    activate = body.use_activation is not False
    data = []
    tokens = 0
    for i, (seq, score) in enumerate(zip(seqs, scores, strict=True)):
        values = probs(score, activate)
        best = max(range(len(values)), key=lambda j: values[j])
        data.append(
            {"index": i, "label": f"LABEL_{best}", "probs": values, "num_classes": len(values)}
        )
        tokens += score.rm_tokens if score.rm_tokens is not None else len(seq.get("tokens", ()))
    return Json(
        {
            "id": request_id("classify"),
            "object": "list",
            "created": int(time.time()),
            "model": await core.model_name(),
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }
    )


@router.post("/classify")
async def classify(body: ClassifyRequest, request: Request) -> Json:
    """Reward scores in vLLM's classification format."""
    return await _classify(body, request, "/classify")


@router.post("/v1/classify")
async def classify_v1(body: ClassifyRequest, request: Request) -> Json:
    """``/classify`` under the OpenAI-style prefix (SGLang's and vLLM's newer path)."""
    return await _classify(body, request, "/v1/classify")
