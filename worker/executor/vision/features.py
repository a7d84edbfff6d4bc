"""A padded batch of image sequences for a vision-language model: the 3-row positions, and the
vision tower run once per distinct image of the batch.

``vision_batch`` lays the sequences out as ``packing.pad`` does (right padding, a padding mask)
with ``position_ids`` ``[3, R, T]``: each sequence's own mRoPE positions (``intake``; a
text-only sequence's are ``0 .. L-1`` in every row), pads at 0. ``image_inputs`` runs
``get_image_features`` once per distinct image and lists the features in the order the image
runs appear in the batch (row by row), which is the order the model's own ``masked_scatter``
places them; they reach the model as ``mm_encoder_outputs`` and the model itself puts them at
the image tokens. Naive equivalent: each sequence alone through the model with its processor's
``pixel_values`` and ``get_rope_index`` positions (``tests/executor/test_vision.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from worker.executor.packing import ForwardBatch, pad
from worker.scorer.inputs import PreparedSequence


def vision_batch(seqs: Sequence[PreparedSequence], seq_ids: Sequence[int]) -> ForwardBatch:
    """``pad`` of ``seqs`` with ``[3, R, T]`` positions and the batch's images (in order)."""
    batch = pad([s.ids for s in seqs], seq_ids)
    rows, width = batch.input_ids.shape
    pos = np.zeros((3, rows, width), dtype=np.int64)  # [3, R, T]
    images: list[Any] = []
    for r, seq in enumerate(seqs):
        n = len(seq.ids)
        if seq.vision is None:
            pos[:, r, :n] = np.arange(n)
        else:
            pos[:, r, :n] = seq.vision.positions
            images.extend(seq.vision.images)
    return replace(batch, position_ids=torch.from_numpy(pos), images=tuple(images))


def image_inputs(model: Any, images: Sequence[Any], device: torch.device) -> tuple[Any, int, float]:
    """``mm_encoder_outputs`` for ``images`` (``ProcessedImage`` s in order of appearance): the
    vision tower run once per distinct digest; also the number it ran on and its seconds."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    started = time.perf_counter()
    distinct: dict[str, Any] = {}
    for img in images:
        distinct.setdefault(img.digest + repr(img.grid), img)
    keys = list(distinct)
    pixels = torch.from_numpy(np.concatenate([distinct[k].pixel_values for k in keys]))
    grids = torch.tensor([distinct[k].grid for k in keys], dtype=torch.int64)
    out = model.model.get_image_features(pixels.to(device), grids.to(device), return_dict=True)
    by_key = dict(zip(keys, out.pooler_output, strict=True))  # each [tokens, H]
    feats = tuple(by_key[img.digest + repr(img.grid)] for img in images)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    encoded = BaseModelOutputWithPooling(pooler_output=feats)  # type: ignore[arg-type]  # per image
    return encoded, len(keys), time.perf_counter() - started
