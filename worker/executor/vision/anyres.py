"""LLaVA-NeXT's and LLaVA-OneVision's rule (anyres): an image's token count depends on its size.

The processor splits an image into a base view and ``P - 1`` tiles of the best
``image_grid_pinpoints`` resolution (``pixel_values`` ``[1, P, 3, S, S]``, ``image_sizes`` the
original ``(h, w)``); the model's ``pack_image_features`` puts the base view's
``(S / patch)**2`` features first, then the tiles' feature grid with the letterbox padding cut
off (``unpad_image``; OneVision also shrinks a grid over ``anyres_max_N`` by bilinear
interpolation), one ``image_newline`` feature after each grid row. All of them are image
tokens: one run per image, of
``(S / patch)**2 + rows * (cols + 1)`` tokens, computed here with the model's own shape functions
(``get_anyres_image_grid_shape``, ``unpad_image`` on an empty grid), so the count is what
``get_image_features`` returns for that image.

A processed image keeps ``pixel_values`` ``[P, 3, S, S]`` and grid ``(P, h, w)``: the distinct
images of a batch concatenate to the ``[sum P, 3, S, S]`` the tower takes, and ``image_sizes`` is
the grids' last two columns. Each image is processed alone, so every image is tiled (OneVision's
processor tiles an image only when a sample shows one image: a sequence's reference forward
passes its images as a flat list, ``batch_num_images`` all 1).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np
import torch

from worker.errors import BadRequest

ANYRES = ("llava_next", "llava_onevision")
"""The served model types with size-dependent image-token counts."""


def _functions(model: Any) -> Any:
    """The modeling module of ``model`` (``get_anyres_image_grid_shape``, ``unpad_image``)."""
    return sys.modules[type(model.model).__module__]


def anyres_tokens(model: Any, height: int, width: int) -> int:
    """The image tokens of an image of original size ``height x width`` (module docstring)."""
    config = model.config
    vision = config.vision_config
    side = int(vision.image_size) // int(vision.patch_size)
    fns = _functions(model)
    size = (height, width)
    patches = fns.image_size_to_num_patches(size, config.image_grid_pinpoints, vision.image_size)
    if patches <= 1:  # the base view alone, then one newline
        return side * side + 1
    rows, cols = fns.get_anyres_image_grid_shape(
        size, config.image_grid_pinpoints, vision.image_size
    )
    grid = fns.unpad_image(torch.empty(0, rows * side, cols * side), size)  # [0, h, w]
    h, w = int(grid.shape[1]), int(grid.shape[2])
    if config.model_type == "llava_onevision":
        most = int(str(config.vision_aspect_ratio).removeprefix("anyres_max_"))
        ratio = math.sqrt(h * w / (most * side**2))
        if ratio > 1.1:
            h, w = int(h // ratio), int(w // ratio)
    return side * side + h * (w + 1)


def anyres_count(model: Any, out: Any) -> tuple[tuple[int, int, int], tuple[int, ...]]:
    """``((P, h, w), (tokens,))`` of one image from the processor's output ``out`` (numpy):
    ``P`` views (base and tiles), ``(h, w)`` the original size, one run of ``anyres_tokens``."""
    pixels = np.asarray(out["pixel_values"])  # [1, P, 3, S, S]
    height, width = (int(x) for x in np.asarray(out["image_sizes"])[0])
    config = model.config
    want = _functions(model).image_size_to_num_patches(
        (height, width), config.image_grid_pinpoints, config.vision_config.image_size
    )
    if pixels.shape[1] != want:  # the processor's pinpoints differ from the model's
        raise BadRequest(
            f"{type(model).__name__}: the image processor made {pixels.shape[1]} views of a "
            f"{height}x{width} image but the model expects {want} (image_grid_pinpoints differ)"
        )
    return (int(pixels.shape[1]), height, width), (anyres_tokens(model, height, width),)


def anyres_pixels(out: Any) -> np.ndarray:
    """The ``[P, 3, S, S]`` kept of an image's ``pixel_values`` ``[1, P, 3, S, S]``."""
    return np.asarray(out["pixel_values"])[0]


def anyres_features(model: Any, pixels: torch.Tensor, grids: torch.Tensor) -> list[Any]:
    """The tower, projector and ``pack_image_features`` on ``pixels`` ``[sum P, 3, S, S]`` of
    distinct images of ``grids`` ``[n, 3]``: one ``[tokens, H]`` per image, in order."""
    config = model.config
    extra: dict[str, Any] = {}
    if config.model_type == "llava_onevision":
        extra["vision_aspect_ratio"] = config.vision_aspect_ratio
    out = model.model.get_image_features(
        pixel_values=pixels,
        image_sizes=grids[:, 1:],
        vision_feature_layer=config.vision_feature_layer,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        return_dict=True,
        **extra,
    )
    return list(out.pooler_output)


def anyres_inputs(images: list[Any]) -> dict[str, torch.Tensor]:
    """The model's own pixel inputs of one sequence's ``images`` (``ProcessedImage`` s) as its
    processor batches them: ``pixel_values`` ``[n, max P, 3, S, S]`` (zero views past an image's
    own) and ``image_sizes`` ``[n, 2]``."""
    most = max(img.pixel_values.shape[0] for img in images)
    stacked = np.zeros((len(images), most, *images[0].pixel_values.shape[1:]), dtype=np.float32)
    for i, img in enumerate(images):
        stacked[i, : img.pixel_values.shape[0]] = img.pixel_values
    sizes = torch.tensor([img.grid[1:] for img in images], dtype=torch.int64)
    return {"pixel_values": torch.from_numpy(stacked), "image_sizes": sizes}
