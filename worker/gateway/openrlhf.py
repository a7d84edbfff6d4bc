"""OpenRLHF's remote reward model: ``POST /get_reward``.

The peer's client: ``openrlhf/utils/agent.py`` (``SingleTurnAgentExecutor._fetch_rewards_via_http``
posts ``{"query": [str], "prompts": [str], "labels": [...]}``, one sample per request with a
180 s timeout and 5 tries, and reads ``rewards``, ``scores`` and ``extra_logs`` of the answer;
with several URLs the others get empty lists) and ``openrlhf/utils/remote_rm_utils.py``
(``{"query": queries}``, reads ``rewards``). The reference server it replaces:
``openrlhf/cli/serve_rm.py`` (answers ``{"rewards": [...]}``).

Each ``query`` is the policy's prompt + response text, chat template and special tokens kept
(OpenRLHF decodes it with ``skip_special_tokens=False``): it is scored as ``text``, tokenized by
the reward model's own tokenizer as given. Empty lists get empty lists.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictStr
from starlette.requests import Request

from worker.client.coalesce import BatchKey
from worker.gateway.http import Json, Router, core_of

router = Router()


class RewardRequest(BaseModel):
    """OpenRLHF's body, field by field."""

    model_config = ConfigDict(extra="ignore")

    query: list[StrictStr] = Field(default_factory=list)
    prompts: list[Any] | None = None
    labels: list[Any] | None = None


class RewardResponse(BaseModel):
    """What OpenRLHF reads: one reward per query (``scores`` the same values)."""

    rewards: list[float]
    scores: list[float]
    extra_logs: dict[str, Any] = Field(default_factory=dict)


@router.post("/get_reward")
async def get_reward(body: RewardRequest, request: Request) -> Json:
    """Score each ``query`` with the reward model."""
    seqs = [{"text": q} for q in body.query]
    scores = await core_of(request).score("/get_reward", seqs, BatchKey(mode="reward"))
    rewards = [float(s.reward) if s.reward is not None else float("nan") for s in scores]
    return Json(RewardResponse(rewards=rewards, scores=rewards).model_dump())
