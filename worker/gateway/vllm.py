"""vLLM's prompt log-prob routes: ``POST /v1/completions`` (token-id prompts with
``prompt_logprobs``) and ``POST /inference/v1/generate`` (vLLM's tokens-in route).

Peers' clients:

* TRL's teacher client, ``trl/generation/vllm_client.py`` (``VLLMClient.get_sequence_logprobs``
  posts ``{"model", "prompt": [[ids]], "max_tokens": 1, "temperature", "prompt_logprobs": k}``
  and parses each choice with ``_format_sequence_logprobs``: ``choices[i].prompt_logprobs[pos]``
  sorted by ``rank``, the actual token looked up by ``str(id)``); it first reads ``GET /health``
  and ``GET /v1/models`` (``data[0].id`` becomes ``model``). Used by TRL's distillation trainers
  (``teacher_model_server_url``).
* prime-rl, ``src/prime_rl/utils/client.py`` (``prefill_logprobs`` posts ``{"model",
  "token_ids", "sampling_params": {"max_tokens": 1, "temperature": 1.0, "top_p": 1.0,
  "prompt_logprobs": 1}}`` to ``/inference/v1/generate`` and reads the first value of each
  ``prompt_logprobs`` dict as the actual token's log-prob; the response model is vLLM's
  ``GenerateResponse``, ``vllm/entrypoints/serve/disagg/protocol.py``).

Teacher log-probs at chosen ids (vLLM's ``docs/training/prompt_token_id_logprobs.md``):
``sampling_params.prompt_logprob_token_ids`` (one candidate list for every scored row, or one list
per row) from ``prompt_logprob_start`` on ``/inference/v1/generate`` answer
``prompt_token_id_logprobs``, a base64 ``.npy`` float32 ``[rows, K]`` (row ``i`` scores token
``start + i + 1``; ``worker.gateway.logprobs.ChosenIds``), beside ``prompt_logprobs`` when that
is asked too (else ``null``); slime's per-position teacher scoring sends these.

Scoring only: ``max_tokens`` above 1, ``n`` above 1, ``stream``, sampled-token ``logprobs`` and
text prompts are a 400; with ``max_tokens`` 1 the answer carries no generated text (``text`` is
``""``, ``finish_reason`` ``"length"``, no generated token ids). The log-probs use
``logits / temperature`` (0 or absent: the raw logits); vLLM itself ignores the temperature for
prompt log-probs, TRL asks for it. Entry format, ``rank`` included: ``worker.gateway.logprobs``.
``model`` picks the weights (``GatewayCore.weights``).
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr
from starlette.requests import Request

from worker.client.coalesce import BatchKey
from worker.client.results import SeqScore
from worker.gateway.errors import GatewayError
from worker.gateway.http import (
    Json,
    Router,
    TokenId,
    core_of,
    request_id,
    scoring_only,
    temperature,
)
from worker.gateway.logprobs import ChosenIds, vllm_prompt_logprobs

router = Router()

#: An id of ``prompt_logprob_token_ids``: a token id, or -1 (a row's padding: ``-inf`` back).
CandidateId = Annotated[StrictInt, Field(ge=-1, le=2**31 - 1)]


class CompletionRequest(BaseModel):
    """vLLM's ``CompletionRequest``, the fields that bear on scoring (others are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: list[list[TokenId]] | list[TokenId] | StrictStr | list[StrictStr]
    max_tokens: int | None = None
    temperature: float | None = None
    prompt_logprobs: int | None = None
    logprobs: int | None = None
    n: int = 1
    stream: bool = False
    return_token_ids: bool | None = None


class SamplingParams(BaseModel):
    """vLLM's ``SamplingParams`` as ``/inference/v1/generate`` takes them (scoring fields)."""

    model_config = ConfigDict(extra="ignore")

    max_tokens: int | None = None
    temperature: float | None = None
    prompt_logprobs: int | None = None
    logprobs: int | None = None
    n: int = 1
    prompt_logprob_token_ids: list[list[CandidateId]] | list[CandidateId] | None = None
    prompt_logprob_start: int | None = None


class GenerateRequest(BaseModel):
    """vLLM's ``GenerateRequest`` (tokens in), field by field where it matters."""

    model_config = ConfigDict(extra="ignore")

    request_id: StrictStr | None = None
    token_ids: list[TokenId]
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    model: StrictStr | None = None
    stream: bool | None = False


def _check(
    n: int, stream: bool | None, logprobs: int | None, k: int | None, ids: bool = False
) -> int | None:
    """The top-k of a scoring request (None: no ``prompt_logprobs``, allowed only with
    ``ids``, ``prompt_logprob_token_ids``); 400 for what only generation could answer."""
    if n != 1:
        raise GatewayError("bad_request", f"n={n}: one choice per prompt (nothing is sampled)")
    if stream:
        raise GatewayError("bad_request", "stream is not supported: the answer comes at once")
    if logprobs:
        raise GatewayError(
            "bad_request", "logprobs of generated tokens: nothing is generated; use prompt_logprobs"
        )
    if k is None:
        if ids:
            return None
        raise GatewayError(
            "bad_request",
            "set prompt_logprobs (0 for the actual tokens only, k "
            "for the top k too) or prompt_logprob_token_ids: this gateway only scores prompts",
        )
    if k < 0:
        raise GatewayError(
            "bad_request",
            f"prompt_logprobs={k}: the whole vocabulary (-1) is not served; ask for a top k",
        )
    return k


def _key(
    k: int | None,
    temp: float,
    weights: tuple[str | None, str | None],
    chosen: ChosenIds | None = None,
) -> BatchKey:
    """The job settings: ``logps`` and ``rank`` (+ ``topk``) for ``prompt_logprobs`` k, and
    ``gather`` for chosen ids."""
    outputs: tuple[str, ...] = ()
    if k is not None:
        outputs = ("logps", "rank", "topk") if k else ("logps", "rank")
    if chosen is not None:
        outputs += ("gather",)
    return BatchKey(
        mode="reference",
        temperature=temp,
        outputs=outputs,
        topk=k or None,
        adapter=weights[0],
        version=weights[1],
        gather_width=chosen.width if chosen is not None else None,
    )


async def _score(
    request: Request, route: str, prompts: list[list[int]], k: int, temp: float, model: str | None
) -> list[SeqScore]:
    for i, ids in enumerate(prompts):
        if len(ids) < 2:
            raise GatewayError(
                "bad_request",
                f"prompt {i} has {len(ids)} tokens: at least 2 (the first has no log-prob)",
            )
    core = core_of(request)
    key = _key(k, temp, await core.weights(model))
    seqs = [{"tokens": ids, "prompt_len": 1} for ids in prompts]
    return await core.score(route, seqs, key)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Json:
    """Prompt log-probs of token-id prompts, as vLLM's ``/v1/completions`` answers them."""
    scoring_only(body.max_tokens)
    k = _check(body.n, body.stream, body.logprobs, body.prompt_logprobs)
    assert k is not None  # _check refuses a missing prompt_logprobs without chosen ids
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
        raise GatewayError(
            "bad_request", "text prompts are not served: send token ids (prompt: [[ids], ...])"
        )
    prompts: list[list[int]] = (
        [list(prompt)] if prompt and isinstance(prompt[0], int) else [list(p) for p in prompt]  # type: ignore[arg-type]
    )
    scores = await _score(
        request, "/v1/completions", prompts, k, temperature(body.temperature), body.model
    )
    choices = []
    for i, (ids, score) in enumerate(zip(prompts, scores, strict=True)):
        choice: dict[str, Any] = {
            "index": i,
            "text": "",
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_logprobs": vllm_prompt_logprobs(ids, score, k),
        }
        if body.return_token_ids:
            choice["prompt_token_ids"] = ids
            choice["token_ids"] = []
        choices.append(choice)
    n = sum(len(p) for p in prompts)
    return Json(
        {
            "id": request_id("cmpl"),
            "object": "text_completion",
            "created": int(time.time()),
            "model": await core_of(request).model_name(),
            "choices": choices,
            "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0},
        }
    )


@router.post("/inference/v1/generate")
async def generate(body: GenerateRequest, request: Request) -> Json:
    """Prompt log-probs of ``token_ids``, and the log-probs at chosen ids
    (``prompt_logprob_token_ids``), as vLLM's ``GenerateResponse``."""
    params = body.sampling_params
    scoring_only(params.max_tokens)
    given = params.prompt_logprob_token_ids
    k = _check(params.n, body.stream, params.logprobs, params.prompt_logprobs, given is not None)
    ids = list(body.token_ids)
    if len(ids) < 2:
        raise GatewayError(
            "bad_request", f"prompt has {len(ids)} tokens: at least 2 (the first has no log-prob)"
        )
    chosen = ChosenIds.of(len(ids), given, params.prompt_logprob_start) if given else None
    if given is not None and chosen is None:
        raise GatewayError("bad_request", "prompt_logprob_token_ids names no id")
    first = 1 if k is not None or chosen is None else chosen.start + 1
    score = None
    if first < len(ids):
        core = core_of(request)
        key = _key(k, temperature(params.temperature), await core.weights(body.model), chosen)
        seq: dict[str, Any] = {"tokens": ids, "prompt_len": first}
        if chosen is not None:
            seq["gather_ids"] = chosen.gather_ids(first, len(ids))
        (score,) = await core.score("/inference/v1/generate", [seq], key)
    prompt_logprobs = None
    if k is not None:
        assert score is not None  # scored from position 1, and the prompt has 2 tokens or more
        prompt_logprobs = vllm_prompt_logprobs(ids, score, k)
    answer: dict[str, Any] = {
        "request_id": body.request_id or request_id("gen"),
        "choices": [{"index": 0, "logprobs": None, "finish_reason": "length", "token_ids": []}],
        "prompt_logprobs": prompt_logprobs,
        "kv_transfer_params": None,
    }
    if chosen is not None:
        answer["prompt_token_id_logprobs"] = chosen.answer(score, first)
    return Json(answer)
