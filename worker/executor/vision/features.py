"""A padded batch of image sequences for a vision-language model: its positions, the vision
tower run once per distinct image of the batch, and the model's extra inputs.

``vision_batch`` lays the sequences out as ``packing.pad`` does (right padding, a padding mask)
with each sequence's own positions (``intake``): ``[3, R, T]`` for Qwen's mRoPE (a text-only
sequence's are ``0 .. L-1`` in every row), ``[R, T]`` ``0 .. L-1`` for LLaVA and Gemma-3, pads
at 0. ``image_inputs`` runs the model's ``get_image_features`` once per distinct image
(``VisionModel.features``) and lists the features in the order the image runs appear in the
batch (row by row), which is the order the model's own ``masked_scatter`` places them; they
reach the model as ``mm_encoder_outputs`` and the model itself puts them at the image tokens
(Qwen3-VL's deepstack features too, per layer in the same order).
Beside them go the model's extra inputs (``token_inputs``: Gemma-3's ``token_type_ids``, 1 on
image tokens, each row its own sequence's, so every image block attends bidirectionally
within itself). Naive equivalent: each sequence alone through the model with its processor's
``pixel_values`` (and positions, token types) (``tests/executor/test_vision.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from worker.executor.packing import ForwardBatch, pad
from worker.executor.vision.arch import VisionModel, vision_model
from worker.scorer.inputs import PreparedSequence


def vision_batch(seqs: Sequence[PreparedSequence], seq_ids: Sequence[int]) -> ForwardBatch:
    """``pad`` of ``seqs`` with their positions (``[3, R, T]`` when theirs are 3-row, else
    ``[R, T]``) and the batch's images (in order)."""
    batch = pad([s.ids for s in seqs], seq_ids)
    rows, width = batch.input_ids.shape
    mrope = any(s.vision is not None and s.vision.positions.ndim == 2 for s in seqs)
    pos = np.zeros((3, rows, width), dtype=np.int64)  # [3, R, T]
    images: list[Any] = []
    for r, seq in enumerate(seqs):
        n = len(seq.ids)
        if seq.vision is None:
            pos[:, r, :n] = np.arange(n)
        else:
            pos[:, r, :n] = seq.vision.positions
            images.extend(seq.vision.images)
    laid = torch.from_numpy(pos if mrope else pos[0])
    return replace(batch, position_ids=laid, images=tuple(images))


def token_inputs(vlm: VisionModel, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's extra inputs for rows ``input_ids`` (``VisionModel.extra``)."""
    return vlm.extra(input_ids)


def vision_inputs(
    model: Any, batch: ForwardBatch, device: torch.device
) -> tuple[dict[str, Any], int, float]:
    """Everything the forward passes beside a laid-out ``batch`` (on ``device``) with images:
    ``mm_encoder_outputs`` (``image_inputs``) and the extra inputs (``token_inputs``); also the
    number of images the tower ran on and its seconds."""
    vlm = vision_model(model)
    assert vlm is not None
    encoded, ran, seconds = image_inputs(vlm, batch.images, device)
    extra = token_inputs(vlm, batch.input_ids)
    return {"mm_encoder_outputs": {"image": encoded}, **extra}, ran, seconds


def image_inputs(
    vlm: VisionModel, images: Sequence[Any], device: torch.device
) -> tuple[Any, int, float]:
    """``mm_encoder_outputs`` for ``images`` (``ProcessedImage`` s in order of appearance): the
    vision tower run once per distinct digest; also the number it ran on and its seconds."""
    started = time.perf_counter()
    distinct: dict[str, Any] = {}
    for img in images:
        distinct.setdefault(img.digest + repr(img.grid), img)
    keys = list(distinct)
    pixels = torch.from_numpy(np.concatenate([distinct[k].pixel_values for k in keys]))
    grids = torch.tensor([distinct[k].grid for k in keys], dtype=torch.int64)
    out = vlm.features(pixels.to(device), grids.to(device))
    by_key = dict(zip(keys, out, strict=True))  # each [tokens, H]
    encoded = vlm.placed([by_key[img.digest + repr(img.grid)] for img in images])  # per image
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return encoded, len(keys), time.perf_counter() - started
