"""SGLang's native ``POST /generate`` for prompt log-probs (slime's on-policy distillation:
``--opd-type sglang --rm-url URL``).

The peer's client: ``slime/rollout/on_policy_distillation.py`` (``reward_func`` posts
``{"input_ids": sample.tokens, "sampling_params": {"temperature": 0, "max_new_tokens": 0,
"skip_special_tokens": false}, "return_logprob": true, "logprob_start_len": 0}`` and
``post_process_rewards`` reads ``meta_info.input_token_logprobs[1:]``, item ``[0]`` of each, the
last ``response_length`` of them). The answer mirrors SGLang's
(``python/sglang/srt/managers/io_struct.py``, ``GenerateReqInput``; the
``meta_info`` of ``tokenizer_manager.py``): ``{"text": "", "output_ids": [], "meta_info": {"id",
"finish_reason": {"type": "length", "length": 0}, "prompt_tokens", "completion_tokens": 0,
"cached_tokens": 0, "input_token_logprobs": [[logprob, id, None], ...], "output_token_logprobs":
[], "input_top_logprobs": ... (with ``top_logprobs_num``), "output_top_logprobs": []}}``; a
batch of ``input_ids`` lists gets a list of those.

Scoring only: ``max_new_tokens`` must be 0, ``return_logprob`` true, ``logprob_start_len`` >= 0
(``-1``, SGLang's default, returns no input log-probs); text input, ``stream`` and per-item
parameter lists are a 400. Temperature: 0 or absent scores the raw logits (what SGLang's input
log-probs are), a positive one ``logits / temperature``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictStr
from starlette.requests import Request

from worker.client.coalesce import BatchKey
from worker.gateway.errors import GatewayError
from worker.gateway.http import Json, Router, TokenId, core_of, request_id, temperature
from worker.gateway.logprobs import sglang_input_logprobs

router = Router()


class SamplingParams(BaseModel):
    """SGLang's sampling parameters (the scoring fields; others are ignored)."""

    model_config = ConfigDict(extra="ignore")

    max_new_tokens: int | None = None
    temperature: float | None = None


class GenerateRequest(BaseModel):
    """SGLang's ``GenerateReqInput``, the fields that bear on scoring."""

    model_config = ConfigDict(extra="ignore")

    input_ids: list[list[TokenId]] | list[TokenId] | None = None
    text: StrictStr | list[StrictStr] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    rid: StrictStr | None = None
    stream: bool = False
    model: StrictStr | None = None


def _check(body: GenerateRequest) -> list[list[int]]:
    if body.text is not None or body.input_ids is None:
        raise GatewayError("bad_request", "send input_ids: text input is not served")
    if body.stream:
        raise GatewayError("bad_request", "stream is not supported: the answer comes at once")
    if body.sampling_params.max_new_tokens != 0:
        raise GatewayError(
            "bad_request",
            f"max_new_tokens={body.sampling_params.max_new_tokens}"
            ": this gateway scores input tokens and generates nothing; send "
            "max_new_tokens 0",
        )
    if not body.return_logprob or body.logprob_start_len < 0:
        raise GatewayError(
            "bad_request",
            "set return_logprob true and logprob_start_len >= 0 (0: every input token)",
        )
    if body.top_logprobs_num < 0:
        raise GatewayError("bad_request", "top_logprobs_num must be >= 0")
    ids: Any = body.input_ids
    batch: list[list[int]] = (
        [list(x) for x in ids] if ids and isinstance(ids[0], list) else [list(ids)]
    )
    for i, seq in enumerate(batch):
        if len(seq) < 2 or body.logprob_start_len >= len(seq):
            raise GatewayError(
                "bad_request",
                f"input {i}: {len(seq)} tokens, logprob_start_len "
                f"{body.logprob_start_len}: at least 2 tokens, start < length",
            )
    return batch


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Json:
    """Input-token log-probs in SGLang's format."""
    batch = _check(body)
    start, k = body.logprob_start_len, body.top_logprobs_num
    core = core_of(request)
    adapter, version = await core.weights(body.model)
    outputs = ("logps", "topk") if k else ("logps",)
    key = BatchKey(
        mode="reference",
        temperature=temperature(body.sampling_params.temperature),
        outputs=outputs,
        topk=k or None,
        adapter=adapter,
        version=version,
    )
    seqs = [{"tokens": ids, "prompt_len": max(start, 1)} for ids in batch]
    scores = await core.score("/generate", seqs, key)
    out = []
    for ids, score in zip(batch, scores, strict=True):
        tok, tops = sglang_input_logprobs(ids, score, start, k)
        meta: dict[str, Any] = {
            "id": body.rid or request_id("gen"),
            "finish_reason": {"type": "length", "length": 0},
            "prompt_tokens": len(ids),
            "completion_tokens": 0,
            "cached_tokens": 0,
            "input_token_logprobs": tok,
            "output_token_logprobs": [],
        }
        if tops is not None:
            meta["input_top_logprobs"] = tops
            meta["output_top_logprobs"] = []
        out.append({"text": "", "output_ids": [], "meta_info": meta})
    single = not (body.input_ids and isinstance(body.input_ids[0], list))
    return Json(out[0] if single else out)
