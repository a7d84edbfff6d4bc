"""slime's remote reward model: ``POST /reward`` (``--rm-type remote_rm --rm-url URL``).

The peer's client: ``slime/rollout/rm_hub/__init__.py`` (``remote_rm`` posts ``{"prompt",
"response", "label"}`` per sample, 120 s timeout, 10 tries, and uses the JSON answer itself as
the reward: a number, or with ``--reward-key`` a dict read by that key).

The answer is the bare number. ``prompt`` + ``response`` is scored as ``text`` (tokenized by the
reward model's own tokenizer as given); a ``prompt`` that is a list of chat messages (slime
keeps it so without ``--apply-chat-template``) is scored as ``messages`` with the response as
the assistant's turn, rendered by the reward model's chat template.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictStr
from starlette.requests import Request

from worker.client.coalesce import BatchKey
from worker.gateway.http import Json, Router, core_of

router = Router()


class SlimeRequest(BaseModel):
    """slime's body, field by field."""

    model_config = ConfigDict(extra="ignore")

    prompt: StrictStr | list[dict[str, Any]]
    response: StrictStr
    label: Any = None


def sequence(body: SlimeRequest) -> dict[str, Any]:
    """The sequence map to score: ``text`` or ``messages``."""
    if isinstance(body.prompt, str):
        return {"text": body.prompt + body.response}
    return {"messages": [*body.prompt, {"role": "assistant", "content": body.response}]}


@router.post("/reward")
async def reward(body: SlimeRequest, request: Request) -> Json:
    """The reward of ``prompt + response``, as a bare JSON number."""
    (score,) = await core_of(request).score("/reward", [sequence(body)], BatchKey(mode="reward"))
    return Json(float(score.reward) if score.reward is not None else float("nan"))
