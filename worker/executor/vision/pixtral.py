"""Mistral-3's rule (a Pixtral vision tower): an image is rows of image tokens.

``PixtralProcessor`` resizes an image to multiples of ``patch * spatial_merge_size`` pixels (it
passes that as the image processor's ``patch_size``; the worker does the same, ``PROCESS``) and
writes it as ``rows`` rows of ``cols`` ``[IMG]`` tokens, each row followed by ``[IMG_BREAK]``
but the last, followed by ``[IMG_END]``: ``rows`` runs of the image token per image, each of
``cols`` tokens (``rows = H / (patch * merge)``, ``cols = W / (patch * merge)``). The tower sees
each image at its own size (``image_sizes``: the processed ``(H, W)``; a batch pads to the largest
and the tower crops each back, with attention blocked per image), the patch merger gives
``rows * cols`` features per image in row order: they land on the image's runs in order.

A processed image keeps its pixels as rows ``[H * W, 3]`` (images of different sizes
concatenate along the first axis, like Qwen's patches) and grid ``(1, H, W)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

PIXTRAL = ("mistral3",)
"""The served model types with a Pixtral vision tower."""


def process_options(model: Any) -> dict[str, Any]:
    """The image processor's arguments ``PixtralProcessor`` passes: ``patch_size`` of
    ``patch * spatial_merge_size`` pixels."""
    config = model.config
    side = int(config.vision_config.patch_size) * int(config.spatial_merge_size)
    return {"patch_size": {"height": side, "width": side}}


def pixtral_count(model: Any, out: Any) -> tuple[tuple[int, int, int], tuple[int, ...]]:
    """``((1, H, W), (cols,) * rows)`` of one image from the processor's output (numpy)."""
    height, width = (int(x) for x in np.asarray(out["image_sizes"])[0])
    side = process_options(model)["patch_size"]["height"]
    rows, cols = height // side, width // side
    return (1, height, width), (cols,) * rows


def pixtral_pixels(out: Any) -> np.ndarray:
    """An image's ``pixel_values`` ``[1, 3, H, W]`` as rows ``[H * W, 3]``."""
    height, width = (int(x) for x in np.asarray(out["image_sizes"])[0])
    pixels = np.asarray(out["pixel_values"])[0, :, :height, :width]  # [3, H, W]
    return pixels.reshape(3, height * width).T


def pixtral_batch(pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
    """Rows ``[sum H*W, 3]`` of the images of ``grids`` ``[n, 3]`` as the processor batches
    them: ``[n, 3, max H, max W]``, zero past each image's own size."""
    sizes = [(int(h), int(w)) for _, h, w in grids.tolist()]
    out = pixels.new_zeros(len(sizes), 3, max(h for h, _ in sizes), max(w for _, w in sizes))
    for i, (rows, (h, w)) in enumerate(
        zip(pixels.split([h * w for h, w in sizes]), sizes, strict=True)
    ):
        out[i, :, :h, :w] = rows.T.reshape(3, h, w)
    return out


def pixtral_features(model: Any, pixels: torch.Tensor, grids: torch.Tensor) -> list[Any]:
    """The Pixtral tower and Mistral-3's projector on the distinct images of ``grids``: one
    ``[rows * cols, H]`` per image, in order."""
    out = model.model.get_image_features(
        pixel_values=pixtral_batch(pixels, grids),
        image_sizes=grids[:, 1:],
        vision_feature_layer=model.config.vision_feature_layer,
        return_dict=True,
    )
    return list(out.pooler_output)


def pixtral_inputs(images: list[Any]) -> dict[str, torch.Tensor]:
    """The model's own pixel inputs of one sequence's ``images`` (``ProcessedImage`` s):
    ``pixel_values`` ``[n, 3, max H, max W]`` and ``image_sizes`` ``[n, 2]``."""
    grids = torch.tensor([img.grid for img in images], dtype=torch.int64)
    rows = torch.from_numpy(np.concatenate([img.pixel_values for img in images]))
    return {"pixel_values": pixtral_batch(rows, grids), "image_sizes": grids[:, 1:]}
