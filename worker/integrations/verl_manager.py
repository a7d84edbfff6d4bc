"""A token-exact verl reward manager backed by the fleet: ``ScoringRewardManager`` for
``reward.reward_manager.source=importlib`` (``reward.reward_manager.path=<this file>``,
``name=ScoringRewardManager``).

verl's reward loop builds one manager per worker as ``cls(config, tokenizer, compute_score,
...)`` and awaits ``run_single(data)`` per sample (``RewardManagerBase``,
``verl/experimental/reward_loop/reward_manager/base.py``; ``dapo.py`` shows the data layout):
``data[0].batch["prompts"]`` (left-padded prompt ids), ``["responses"]`` (right-padded response
ids) and ``["attention_mask"]`` over both. The manager sends the unpadded prompt + response ids
as they are (no decode, no re-tokenization: the policy's ids, so the reward model must share the
policy's tokenizer, which the worker checks) and returns ``{"reward_score": r,
"reward_extra_info": {"rm_score": r}}``. Calls of one process are coalesced into fleet-sized
jobs.

The base class is verl's when verl is installed (imported at import time: a subclass needs it),
else a stand-in with the same constructor, so this module imports without verl or torch.
Settings: ``redis_url`` / ``queue`` keyword arguments, else ``SCORING_REDIS_URL`` /
``SCORING_QUEUE``.
"""

from __future__ import annotations

from typing import Any

from worker.client.coalesce import BatchKey
from worker.integrations.shared import coalescer, settings

try:  # the framework's base class, when it is there
    from verl.experimental.reward_loop.reward_manager.base import (
        RewardManagerBase as _Base,
    )
except ImportError:  # verl (or torch) not installed: a stand-in with verl's constructor

    class _Base:  # type: ignore[no-redef]
        def __init__(self, config: Any, tokenizer: Any, compute_score: Any = None) -> None:
            self.config = config
            self.tokenizer = tokenizer
            self.compute_score = compute_score


def _ids(value: Any) -> list[int]:
    return [int(x) for x in (value.tolist() if hasattr(value, "tolist") else value)]


def sequence_of(item: Any) -> dict[str, Any]:
    """The unpadded prompt + response ids of one verl data item, as a sequence map."""
    prompt = _ids(item.batch["prompts"])
    response = _ids(item.batch["responses"])
    mask = _ids(item.batch["attention_mask"])
    n_prompt = sum(mask[: len(prompt)])
    n_response = sum(mask[len(prompt) : len(prompt) + len(response)])
    ids = prompt[len(prompt) - n_prompt :] + response[:n_response]
    return {"tokens": ids, "prompt_len": 1}


class ScoringRewardManager(_Base):
    """verl's ``RewardManagerBase`` scored by the workers of a queue (module docstring)."""

    def __init__(
        self,
        config: Any,
        tokenizer: Any,
        compute_score: Any = None,
        *,
        redis_url: str | None = None,
        queue: str | None = None,
        partitions: int = 1,
        timeout_s: float = 600.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, tokenizer, compute_score)
        self.redis_url, self.queue = settings(redis_url, queue)
        self.partitions = partitions
        self.timeout_s = timeout_s
        self.key = BatchKey(mode="reward")

    async def run_single(self, data: Any) -> dict[str, Any]:
        """The reward of the one item in ``data``."""
        if len(data) != 1:
            raise ValueError(f"run_single takes one item, got {len(data)}")
        seq = sequence_of(data[0])
        batcher = coalescer(self.redis_url, self.queue, self.partitions)
        (score,) = await batcher.score([seq], self.key, self.timeout_s)
        reward = float(score.reward) if score.reward is not None else float("nan")
        return {"reward_score": reward, "reward_extra_info": {"rm_score": reward}}
