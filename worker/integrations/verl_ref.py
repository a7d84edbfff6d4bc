"""verl's reference log-probs from the fleet: ``ref_log_prob(data)``, what verl's ref worker's
``compute_ref_log_prob`` puts under ``ref_log_prob`` (float32 ``[B, R]``, the log-prob of each
response token under the reference model, 0.0 past a response's end), for a ``DataProto`` (or
any sequence of its items) with ``batch["prompts"]`` (left-padded), ``["responses"]``
(right-padded) and ``["attention_mask"]`` over both.

Each item is its unpadded prompt ids (the job's ``prefix``: a group's prompt sent once) and its
response; with ``multi_modal_data`` (verl's ``{"image": [...]}``) its images go with it, each
image-token run of the prompt naming the next image, a group's prompt image once per job
(``worker.client.coalesce``). The temperature is the batch's ``meta_info["temperature"]`` (as
verl's actor divides the logits), else 1.0. Settings as ``worker.integrations.verl_manager``
(keyword arguments, then ``SCORING_*``). Returns numpy (the trainer makes its tensor:
``torch.from_numpy``): this module never imports torch.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from worker.client.coalesce import BatchKey
from worker.integrations.shared import coalescer, settings, wait_unknown
from worker.integrations.verl_manager import images_of, split_of


def _items(data: Any) -> list[Any]:
    return [data[i] for i in range(len(data))]


async def ref_log_prob(
    data: Any,
    *,
    redis_url: str | None = None,
    queue: str | None = None,
    partitions: int = 1,
    timeout_s: float = 600.0,
    temperature: float | None = None,
    adapter: str | None = None,
    version: str | None = None,
    wait_for_unknown_queue: bool | None = None,
) -> np.ndarray:
    """The reference log-probs of every response in ``data``, ``[B, R]`` (module docstring)."""
    items = _items(data)
    if not items:
        return np.zeros((0, 0), dtype=np.float32)
    meta = getattr(data, "meta_info", None) or {}
    temp = float(temperature if temperature is not None else meta.get("temperature", 1.0))
    url, q = settings(redis_url, queue)
    batcher = coalescer(
        url, q, int(partitions), wait_for_unknown_queue=wait_unknown(wait_for_unknown_queue)
    )
    key = BatchKey(mode="reference", temperature=temp, adapter=adapter, version=version)
    width = len(items[0].batch["responses"])

    async def one(item: Any) -> np.ndarray:
        prompt, response = split_of(item)
        if not prompt:
            raise ValueError("a verl item without prompt ids: nothing conditions its response")
        out = np.zeros(width, dtype=np.float32)
        if not response:
            return out
        images = images_of(item)
        seq: dict[str, Any] = {"tokens": response}
        if images:
            seq["images"] = list(range(len(images)))
        (score,) = await batcher.score(
            [seq], key, float(timeout_s), prefix=prompt, images=images or None
        )
        out[: len(response)] = np.asarray(score.logps, dtype=np.float32)
        return out

    rows = await asyncio.gather(*(one(item) for item in items))
    return np.stack(rows)
