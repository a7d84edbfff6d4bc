"""What the LLaVA and Gemma-3 image tests share: placeholders as their processors write them, the
token count per image as transformers' own processors compute it, and the naive reference (each
sequence alone through transformers with its processor's ``pixel_values``, positions
``0 .. L-1`` and, for Gemma-3, ``token_type_ids`` as ``Gemma3Processor`` makes them: 1 where the
token is the image token)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from tests.support.vision import END, IMAGE, START


def image_count(model: Any, processor: Any, data: bytes) -> int:
    """The image tokens transformers' processor writes for ``data``: ``LlavaProcessor``'s
    ``(H // patch) * (W // patch)`` of the processed image (CLS dropped by strategy ``default``),
    ``Gemma3Processor``'s ``image_seq_length`` (``mm_tokens_per_image``), ``SmolVLMProcessor``'s
    and ``Idefics3Processor``'s ``image_seq_len`` (one tile: image splitting off)."""
    config = model.config
    if config.model_type in ("smolvlm", "idefics3"):
        return int(model.model.image_seq_len)
    if config.model_type == "gemma3":
        return int(config.mm_tokens_per_image)
    pixels = processed(processor, [data])["pixel_values"]  # [1, 3, H, W]
    patch = config.vision_config.patch_size
    full = int(config.vision_feature_select_strategy == "full")
    return (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch) + full


def processed(processor: Any, files: Sequence[bytes]) -> Any:
    """The processor's output for ``files`` (decoded as the worker does), torch tensors."""
    images = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    return processor(images=images, return_tensors="pt")


def fixed_placeholder(model: Any, n: int) -> list[int]:
    """One image as its processor expands it: Gemma-3's ``boi``, ``n`` image tokens, ``eoi``;
    LLaVA's ``n`` image tokens; SmolVLM's and Idefics3's ``<fake_token_around_image>``,
    ``<global-img>``, ``n`` image tokens, ``<fake_token_around_image>`` (the tiny models' start
    and end ids stand for the two)."""
    if model.config.model_type in ("smolvlm", "idefics3"):
        return [START, END, *[IMAGE] * n, START]
    if model.config.model_type == "gemma3":
        return [START, *[IMAGE] * n, END]
    return [IMAGE] * n


def fixed_reference(
    model: Any,
    processor: Any,
    files: Sequence[bytes],
    tokens: Sequence[int],
    refs: Sequence[int],
    *,
    temperature: float = 1.0,
    topk: int = 0,
    token_types: bool = True,
) -> dict[str, np.ndarray]:
    """Per position ``t >= 1``: ``logps``, ``entropy`` and, with ``topk``, ``topk_ids`` /
    ``topk_logps`` from one forward of the sequence alone with its images (``files[r]`` for
    ``r`` in ``refs``); ``token_types=False`` leaves out Gemma-3's ``token_type_ids`` (the
    trap: image tokens then attend causally)."""
    ids = torch.tensor([list(tokens)])
    extra: dict[str, Any] = {"position_ids": torch.arange(ids.shape[1])[None]}
    if refs:
        out = processed(processor, [files[r] for r in refs])
        extra["pixel_values"] = out["pixel_values"]
        if "pixel_attention_mask" in out:  # SmolVLM's, Idefics3's
            extra["pixel_attention_mask"] = out["pixel_attention_mask"]
    if model.config.model_type == "gemma3" and token_types:
        extra["token_type_ids"] = (ids == IMAGE).long()
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False, **extra).logits[0, :-1].float()
    logp = (logits / temperature).log_softmax(-1)  # [L-1, V]
    got = {
        "logps": logp.gather(-1, ids[0, 1:, None])[:, 0].numpy(),
        "entropy": -(logp.exp() * logp).sum(-1).numpy(),
    }
    if topk:
        vals, idx = logp.topk(topk, -1)
        got["topk_logps"], got["topk_ids"] = vals.numpy(), idx.numpy()
    return got
