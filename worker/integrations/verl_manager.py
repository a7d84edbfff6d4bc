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
"reward_extra_info": {"rm_score": r}}``. Calls of one process are coalesced, and the samples
of one prompt (GRPO's n rollouts: identical prompt ids) go as one job that carries the prompt
once (protocol ``prefix``) with each response after it; the rest go together in one job, as
before. The worker sees the same sequences either way: the rewards are the same.

Images (a vision-language policy): an item's ``non_tensor_batch["multi_modal_data"]`` (verl's
``{"image": [PIL images]}``; EasyR1's ``"images"`` too) goes with it, each image-token run of the
prompt ids (already expanded by verl's processor) naming the next image; a group's shared prompt
image is sent once per job (``worker.client.coalesce``). The worker scores images in mode
``reference`` only, so a reward job with images is its ``bad_request``, raised as
``BadRequestError`` (reference log-probs with images: ``worker.integrations.verl_ref``).

The base class is verl's when verl is installed (imported at import time: a subclass needs it),
else a stand-in with the same constructor, so this module imports without verl or torch.

Settings (``redis_url``, ``queue``, ``partitions``, ``timeout_s``, ``wait_for_unknown_queue``),
first found wins: the keyword arguments; verl's own config, ``reward.reward_kwargs`` (where
verl's managers read theirs, ``dapo.py``) then ``reward.custom_reward_function.reward_kwargs``;
``SCORING_REDIS_URL`` / ``SCORING_QUEUE`` / ``SCORING_WAIT_FOR_UNKNOWN_QUEUE`` (on other Ray
nodes only through a ``runtime_env``); the defaults. A queue no worker ever served raises
``UnknownQueueError`` at the first call (a typo), unless ``wait_for_unknown_queue``.
"""

from __future__ import annotations

from typing import Any

from worker.client.coalesce import BatchKey
from worker.integrations.shared import coalescer, settings, wait_unknown

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


#: The settings the manager reads from verl's config (module docstring).
SETTINGS = ("redis_url", "queue", "partitions", "timeout_s", "wait_for_unknown_queue")


def _get(section: Any, key: str) -> Any:
    """``section[key]`` of a verl config node (``DictConfig`` or dict); None when absent."""
    if section is None:
        return None
    try:
        return section.get(key)
    except Exception:  # a node that is not a mapping, or a struct config without the key
        return None


def config_settings(config: Any) -> dict[str, Any]:
    """The fleet's settings in verl's config: ``reward.reward_kwargs`` over
    ``reward.custom_reward_function.reward_kwargs`` (only the keys of ``SETTINGS``)."""
    reward = _get(config, "reward")
    found: dict[str, Any] = {}
    for section in (
        _get(_get(reward, "custom_reward_function"), "reward_kwargs"),
        _get(reward, "reward_kwargs"),
    ):
        for key in SETTINGS:
            value = _get(section, key)
            if value is not None:
                found[key] = value
    return found


def _ids(value: Any) -> list[int]:
    return [int(x) for x in (value.tolist() if hasattr(value, "tolist") else value)]


def split_of(item: Any) -> tuple[list[int], list[int]]:
    """The unpadded prompt ids and response ids of one verl data item."""
    prompt = _ids(item.batch["prompts"])
    response = _ids(item.batch["responses"])
    mask = _ids(item.batch["attention_mask"])
    n_prompt = sum(mask[: len(prompt)])
    n_response = sum(mask[len(prompt) : len(prompt) + len(response)])
    return prompt[len(prompt) - n_prompt :], response[:n_response]


def images_of(item: Any) -> list[Any]:
    """The images of one verl data item (``multi_modal_data``'s ``image`` or ``images``, in
    order; ``[]`` without)."""
    extra = getattr(item, "non_tensor_batch", None) or {}
    data = extra.get("multi_modal_data") if hasattr(extra, "get") else None
    if data is None:
        return []
    if not hasattr(data, "get"):
        raise ValueError(f"multi_modal_data must be a dict, got {type(data).__name__}")
    images = data.get("image", data.get("images"))
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def sequence_of(item: Any) -> dict[str, Any]:
    """The unpadded prompt + response ids of one verl data item, as a sequence map."""
    prompt, response = split_of(item)
    return {"tokens": prompt + response, "prompt_len": 1}


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
        partitions: int | None = None,
        timeout_s: float | None = None,
        wait_for_unknown_queue: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, tokenizer, compute_score)
        given = {
            "redis_url": redis_url,
            "queue": queue,
            "partitions": partitions,
            "timeout_s": timeout_s,
            "wait_for_unknown_queue": wait_for_unknown_queue,
        }
        found = {**config_settings(config), **{k: v for k, v in given.items() if v is not None}}
        self.redis_url, self.queue = settings(found.get("redis_url"), found.get("queue"))
        self.partitions = int(found.get("partitions", 1))
        self.timeout_s = float(found.get("timeout_s", 600.0))
        self.wait_for_unknown_queue = wait_unknown(found.get("wait_for_unknown_queue"))
        self.key = BatchKey(mode="reward")

    async def run_single(self, data: Any) -> dict[str, Any]:
        """The reward of the one item in ``data``."""
        if len(data) != 1:
            raise ValueError(f"run_single takes one item, got {len(data)}")
        prompt, response = split_of(data[0])
        batcher = coalescer(
            self.redis_url,
            self.queue,
            self.partitions,
            wait_for_unknown_queue=self.wait_for_unknown_queue,
        )
        # the sequence is prompt + response, prompt_len 1 as ever (the reward head ignores it);
        # the prompt names the group its sample shares a job with (Coalescer.score)
        images = images_of(data[0])
        seq: dict[str, Any] = {"tokens": response, "prompt_len": 1}
        if images:
            seq["images"] = list(range(len(images)))
        (score,) = await batcher.score(
            [seq],
            self.key,
            self.timeout_s,
            prefix=prompt if prompt else None,
            images=images or None,
        )
        reward = float(score.reward) if score.reward is not None else float("nan")
        return {"reward_score": reward, "reward_extra_info": {"rm_score": reward}}
