"""What a batch of image sequences passes beside its ids (laid out by ``vision.layout``): the
vision tower run once per distinct image of the batch (once per image of each sequence with
``ExecutorConfig.image_sharing`` off), and the model's extra inputs.

``image_inputs`` runs the model's ``get_image_features`` once per distinct image
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
from typing import Any

import numpy as np
import torch

from worker.executor.packing import ForwardBatch
from worker.executor.vision.arch import VisionModel, vision_model


def token_inputs(vlm: VisionModel, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's extra inputs for rows ``input_ids`` (``VisionModel.extra``)."""
    return vlm.extra(input_ids)


def packed_block_masks(model: Any, batch: ForwardBatch, device: torch.device) -> dict[str, Any]:
    """Gemma-3's attention masks for packed rows (``{"attention_mask": {"full_attention": ...,
    "sliding_attention": ...}}``), nothing for rows of one sequence each.

    transformers (5.x) builds the sliding mask of ``create_masks_for_vision_model`` with the
    image blocks as an ``or_mask_function`` that its packed-row detection then remaps from
    token indices to positions (``remap_positions_for_packed_sequence``): in a packed row
    every sequence after the first reads the image blocks of the tokens at its positions'
    indices, at the row's start. Both masks here are built on token indices, with the
    sequences the model itself would find from the positions
    (``find_packed_sequence_indices``): OR(causal, image block) AND same sequence, and AND
    the sliding window for sliding layers. Naive equivalent: each sequence alone with its
    ``token_type_ids`` (``tests/executor/test_vision_layouts.py``)."""
    from transformers.masking_utils import (
        and_masks,
        blockwise_overlay,
        create_causal_mask,
        find_packed_sequence_indices,
        packed_sequence_mask_function,
        sliding_window_overlay,
    )
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    vlm = vision_model(model)
    assert vlm is not None
    positions = batch.position_ids.to(device)  # [R, T]
    sequences = find_packed_sequence_indices(positions)  # [R, T] or None
    if sequences is None:
        return {}
    config = model.config.get_text_config()
    rows, width = batch.input_ids.shape
    dtype = next(model.parameters()).dtype
    shape = torch.empty(rows, width, 0, dtype=dtype, device=device)  # [R, T, 0]: sizes only
    types = (batch.input_ids == vlm.image_token).long().to(device)  # [R, T]
    blocks = blockwise_overlay(get_block_sequence_ids_for_mask(types, device=device))
    same = packed_sequence_mask_function(sequences)
    kw = {"config": config, "inputs_embeds": shape, "attention_mask": None, "cache": None}
    full = create_causal_mask(**kw, or_mask_function=blocks, and_mask_function=same)
    window = sliding_window_overlay(config.sliding_window)
    sliding = create_causal_mask(
        **kw, or_mask_function=blocks, and_mask_function=and_masks(window, same)
    )
    return {"attention_mask": {"full_attention": full, "sliding_attention": sliding}}


def vision_inputs(
    model: Any,
    batch: ForwardBatch,
    device: torch.device,
    cache: dict[str, Any] | None = None,
    sharing: str = "on",
) -> tuple[dict[str, Any], int, float]:
    """Everything the forward passes beside a laid-out ``batch`` (on ``device``) with images:
    ``mm_encoder_outputs`` (``image_inputs``, ``cache`` its features by image, ``sharing``
    whether an image is computed once) and the extra inputs (``token_inputs``); also the number
    of images the tower ran on and its seconds."""
    vlm = vision_model(model)
    assert vlm is not None
    encoded, ran, seconds = image_inputs(vlm, batch.images, device, cache, share=sharing == "on")
    extra = token_inputs(vlm, batch.input_ids)
    if vlm.token_types and batch.packed:
        extra.update(packed_block_masks(model, batch, device))
    return {"mm_encoder_outputs": {"image": encoded}, **extra}, ran, seconds


def tower_inputs(
    model: Any,
    batch: ForwardBatch,
    device: torch.device,
    cache: dict[str, Any] | None,
    sharing: str = "on",
) -> tuple[dict[str, Any], int, float]:
    """``vision_inputs`` of a ``batch`` on ``device`` (``cache``: the call's features by image,
    filled here; ``sharing``: ``ExecutorConfig.image_sharing``); nothing for a batch without
    images."""
    if not batch.images:
        return {}, 0, 0.0
    with torch.inference_mode():
        return vision_inputs(model, batch, device, cache, sharing)


def image_key(img: Any) -> str:
    """What identifies an image's features: its content digest and processed grid."""
    return img.digest + repr(img.grid)


def image_inputs(
    vlm: VisionModel,
    images: Sequence[Any],
    device: torch.device,
    cache: dict[str, Any] | None = None,
    *,
    share: bool = True,
) -> tuple[Any, int, float]:
    """``mm_encoder_outputs`` for ``images`` (``ProcessedImage`` s in order of appearance): the
    vision tower run once per distinct image not already in ``cache`` (``image_key`` -> its
    features; a call's forwards share one, so an image shown in several forwards of a call
    runs through the tower once); also the number it ran on and its seconds. ``share`` off:
    once per entry of ``images`` (every sequence's images computed alone, ``cache`` unused)."""
    started = time.perf_counter()
    keys = [image_key(img) if share else str(n) for n, img in enumerate(images)]
    cache = {} if cache is None or not share else cache
    distinct: dict[str, Any] = {}
    for key, img in zip(keys, images, strict=True):
        if key not in cache:
            distinct.setdefault(key, img)
    todo = list(distinct)
    if todo:
        pixels = torch.from_numpy(np.concatenate([distinct[k].pixel_values for k in todo]))
        grids = torch.tensor([distinct[k].grid for k in todo], dtype=torch.int64)
        out = vlm.features(pixels.to(device), grids.to(device))
        cache.update(zip(todo, out, strict=True))  # each [tokens, H]
    encoded = vlm.placed([cache[k] for k in keys])  # per image
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return encoded, len(todo), time.perf_counter() - started
