"""Which vision-language models are served, and what the executor needs to know of one.

Served exactly (``SERVED``), each with its own rule for the image-token count of an image,
positions, the vision tower and any extra input:

- Qwen2-VL, Qwen2.5-VL, Qwen3-VL (and its MoE): ``t*h*w / merge**2`` tokens per image (the
  processor's grid), 3-row mRoPE positions by the model's own ``get_rope_index`` (Qwen3-VL's
  advances by ``max(h, w) / merge`` after an image); Qwen3-VL's tower also gives deepstack
  features, added to the first decoder layers' hidden states at the image tokens, placed per
  image exactly as the main features;
- LLaVA: a fixed count per image, the vision tower's patch grid of the processed image (one more
  with ``vision_feature_select_strategy`` ``full``, which keeps CLS), 1-D positions;
- Gemma-3: ``mm_tokens_per_image`` tokens per image, 1-D positions, and ``token_type_ids`` (1 on
  image tokens) always passed: without them transformers runs image tokens causally instead of
  bidirectionally within their image, silently wrong;
- SmolVLM, Idefics3: ``image_seq_len`` tokens per tile, one run of the image token per tile
  (the processor writes ``<fake_token_around_image><row_r_col_c>`` before each tile of a split
  image and ``<fake_token_around_image><global-img>`` before the global image, last), 1-D
  positions; image splitting on (their default) or off;
- LLaVA-NeXT, LLaVA-OneVision (``anyres``): one run per image whose length depends on the image's
  size (base view, unpadded tile grid, one ``image_newline`` per row), 1-D positions;
- Mistral-3 (``pixtral``): one run of ``cols`` tokens per row of the image (``[IMG_BREAK]``
  between rows, ``[IMG_END]`` after the last), ``image_sizes`` for the tower, 1-D positions.

Each image owns an ordered list of runs (``VisionModel.count``): one run per image but for
Mistral-3 and split SmolVLM / Idefics3 images.

Reward models with images: ``Gemma3ForSequenceClassification`` (``REWARD_SERVED``: Gemma-3's
rule, its backbone ``model.model``), and any served class above read through a hidden-state
reward adapter (a value head on the VLM's last hidden states, ``rewards.pooling``).

Any other model with a vision tower (a config with ``vision_config``: Idefics2, PaliGemma,
Llama-4, ...) is refused at load with its class named: its positions, token types or feature
placement differ, and a forward that ran anyway would be silently wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from worker.errors import BadRequest, ConfigError
from worker.executor.vision.anyres import (
    ANYRES,
    anyres_count,
    anyres_features,
    anyres_inputs,
    anyres_pixels,
)
from worker.executor.vision.pixtral import (
    PIXTRAL,
    pixtral_count,
    pixtral_features,
    pixtral_inputs,
    pixtral_pixels,
    process_options,
)

SERVED: dict[str, str] = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "smolvlm": "SmolVLMForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
}
"""model_type -> the class served for it."""

REWARD_SERVED: dict[str, str] = {"gemma3": "Gemma3ForSequenceClassification"}
"""model_type -> the image-text reward class served with images (its backbone is the served
class's, ``model.model``; the reward read by the worker's head adapter at the last token)."""

MROPE = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
"""The served model types with 3-row mRoPE positions (the others' are ``0 .. L-1``)."""
TILED = ("smolvlm", "idefics3")
"""The served model types whose processor lays an image out as tiles of ``image_seq_len`` tokens
(one tile per image with ``do_image_splitting`` off, one per tile and the global image with it
on)."""
DEEPSTACK = ("qwen3_vl", "qwen3_vl_moe")
"""The served model types whose vision tower also gives deepstack features (one per layer)."""


def has_vision(config: Any) -> bool:
    """Whether a transformers config describes a model with a vision tower."""
    return getattr(config, "vision_config", None) is not None


def served_class(config: Any, loaded: str | None = None) -> str | None:
    """The class to load a checkpoint's ``config`` with: ``None`` for a text-only model, the
    served class of a served image-text model (``SERVED``); ``ConfigError`` naming the class
    (``loaded``, the checkpoint's architecture, or transformers' image-text class of its
    ``model_type``) for any other image-text model."""
    if not has_vision(config):
        return None
    kind = str(getattr(config, "model_type", ""))
    name = SERVED.get(kind)
    if name is None:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as IMAGE_TEXT,
        )

        named = getattr(config, "architectures", None) or [IMAGE_TEXT.get(kind, kind)]
        arch = loaded or named[0]
        raise ConfigError(
            f"{arch} is an image-text model this worker does not serve yet: images are scored "
            f"exactly only for {sorted(SERVED.values())}"
        )
    return name


@dataclass(frozen=True)
class VisionModel:
    """What intake and the forward read of a served vision-language model.

    ``model``: the ``*ForConditionalGeneration``; ``kind``: its ``model_type``;
    ``image_token``, ``video_token``: the placeholder ids; ``merge``: Qwen's spatial merge size
    (an image of grid ``t x h x w`` patches is ``t*h*w / merge**2`` image tokens; 0 for the
    others); ``patch``: LLaVA's patch size; ``fixed``: Gemma-3's tokens per image, SmolVLM's and
    Idefics3's per tile (``image_seq_len``)."""

    model: Any
    kind: str
    image_token: int
    video_token: int | None
    merge: int = 0
    patch: int = 0
    fixed: int = 0

    @property
    def name(self) -> str:
        """The model's class name."""
        return type(self.model).__name__

    @property
    def mrope(self) -> bool:
        """Whether positions are 3-row mRoPE (``get_rope_index``) rather than ``0 .. L-1``."""
        return self.kind in MROPE

    @property
    def token_types(self) -> bool:
        """Whether the forward needs ``token_type_ids`` (Gemma-3's bidirectional image blocks)."""
        return self.kind == "gemma3"

    def count(self, out: Any) -> tuple[tuple[int, int, int], tuple[int, ...]]:
        """``(grid, runs)`` of one image from the processor's output ``out`` (numpy): ``runs``
        its image-token count per run of the image token, in order. Qwen's ``image_grid_thw``
        and one run of ``t*h*w / merge**2``; LLaVA's patch grid ``(1, h, w)`` and one run of
        ``h*w`` (+1 with strategy ``full``); Gemma-3's pixel shape and one run of
        ``mm_tokens_per_image``; SmolVLM's / Idefics3's ``(tiles, H, W)`` and one run of
        ``image_seq_len`` per tile (the global image last); ``anyres`` / ``pixtral`` for
        LLaVA-NeXT, LLaVA-OneVision and Mistral-3."""
        if self.kind in ANYRES:
            return anyres_count(self.model, out)
        if self.kind in PIXTRAL:
            return pixtral_count(self.model, out)
        if self.mrope:
            t, h, w = (int(x) for x in np.asarray(out["image_grid_thw"])[0])
            return (t, h, w), (t * h * w // (self.merge * self.merge),)
        if self.kind in TILED:  # pixel_values [1, tiles, 3, H, W]
            _, n, _, height, width = np.asarray(out["pixel_values"]).shape
            if not np.asarray(out["pixel_attention_mask"]).all():
                raise BadRequest(f"{self.name}: a padded image tile is not served")
            return (int(n), int(height), int(width)), (self.fixed,) * int(n)
        n, _, height, width = np.asarray(out["pixel_values"]).shape
        if self.kind == "llava":
            h, w = height // self.patch, width // self.patch
            full = self.model.config.vision_feature_select_strategy == "full"
            return (int(n), h, w), (int(n) * (h * w + int(full)),)
        return (int(n), int(height), int(width)), (int(n) * self.fixed,)

    def kept(self, out: Any) -> np.ndarray:
        """The ``pixel_values`` kept of one image's processor output (float32): Qwen's
        ``[patches, D]``, LLaVA's and Gemma-3's ``[1, 3, H, W]``, SmolVLM's and Idefics3's tiles
        ``[tiles, 3, H, W]``, LLaVA-NeXT's views ``[P, 3, S, S]``, Mistral-3's rows
        ``[H * W, 3]``: the distinct images of a batch concatenate along the first axis."""
        if self.kind in ANYRES:
            pixels = anyres_pixels(out)
        elif self.kind in PIXTRAL:
            pixels = pixtral_pixels(out)
        elif self.kind in TILED:
            pixels = np.asarray(out["pixel_values"])[0]
        else:
            pixels = np.asarray(out["pixel_values"])
        return np.ascontiguousarray(pixels, dtype=np.float32)

    @property
    def process_options(self) -> dict[str, Any]:
        """Arguments the model's own processor passes its image processor (Mistral-3's
        ``patch_size``), none for the others."""
        return process_options(self.model) if self.kind in PIXTRAL else {}

    def describe(self, grid: tuple[int, int, int]) -> str:
        """How the token count of an image of ``grid`` comes about (``bad_request`` text)."""
        if self.mrope:
            return f"grid {grid}, merge {self.merge}"
        if self.kind == "llava":
            return f"patch grid {grid[1]}x{grid[2]} of patch {self.patch}"
        if self.kind in TILED:
            return f"{grid[0]} tile(s) of image_seq_len {self.fixed}, the global image last"
        if self.kind in ANYRES:
            return f"anyres: {grid[0]} views of a {grid[1]}x{grid[2]} image"
        if self.kind in PIXTRAL:
            side = process_options(self.model)["patch_size"]["height"]
            return f"rows of a {grid[1]}x{grid[2]} image in {side}x{side} patches"
        return f"mm_tokens_per_image {self.fixed}"

    def positions(self, ids: np.ndarray, grids: Sequence[tuple[int, int, int]]) -> np.ndarray:
        """The positions of ``ids`` alone: ``[3, L]`` by Qwen's ``get_rope_index``, else
        ``0 .. L-1`` ``[L]``."""
        if not self.mrope:
            return np.arange(len(ids), dtype=np.int64)
        input_ids = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))[None]  # [1, L]
        types = (input_ids == self.image_token).to(torch.int32)  # [1, L] 1 = image
        thw = torch.tensor(list(grids), dtype=torch.int64)  # [n, 3]
        with torch.inference_mode():
            pos, _ = self.model.model.get_rope_index(input_ids, types, image_grid_thw=thw)
        return pos[:, 0].numpy().astype(np.int64)  # [3, L]

    def features(self, pixels: torch.Tensor, grids: torch.Tensor) -> list[Any]:
        """The vision tower (and projector) on the concatenated ``pixels`` of distinct images:
        one ``[tokens, H]`` per image, in order; Qwen3-VL's: ``(main, deepstack)`` per image,
        ``deepstack`` one ``[tokens, H]`` per deepstack layer."""
        inner = self.model.model
        if self.kind in ANYRES:
            return anyres_features(self.model, pixels, grids)
        if self.kind in PIXTRAL:
            return pixtral_features(self.model, pixels, grids)
        if self.kind in TILED:  # one sample of all tiles: [sum tiles * seq, H], split per image
            (flat,) = inner.get_image_features(pixels[None], return_dict=True).pooler_output
            return list(flat.split([int(g[0]) * self.fixed for g in grids.tolist()]))
        if self.kind in DEEPSTACK:
            out = inner.get_image_features(pixels, grids, return_dict=True)
            deep = out.deepstack_features  # per layer, per image [tokens, H]
            return [
                (main, tuple(layer[i] for layer in deep))
                for i, main in enumerate(out.pooler_output)
            ]
        if self.mrope:
            return list(inner.get_image_features(pixels, grids, return_dict=True).pooler_output)
        if self.kind == "llava":
            config = self.model.config
            out = inner.get_image_features(
                pixel_values=pixels,
                vision_feature_layer=config.vision_feature_layer,
                vision_feature_select_strategy=config.vision_feature_select_strategy,
                return_dict=True,
            )
            return list(out.pooler_output)
        return list(inner.get_image_features(pixels, return_dict=True).pooler_output)

    def model_inputs(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        """The pixel inputs of the model's own forward of one sequence showing ``images``
        (``ProcessedImage`` s, in order) as its processor batches them: ``pixel_values``, and
        Qwen's ``image_grid_thw``, LLaVA-NeXT's and Mistral-3's ``image_sizes``."""
        if self.kind in ANYRES:
            return anyres_inputs(list(images))
        if self.kind in PIXTRAL:
            return pixtral_inputs(list(images))
        pixels = torch.from_numpy(np.concatenate([img.pixel_values for img in images]))
        if self.kind in TILED:  # one sample: [1, tiles, 3, H, W]
            return {"pixel_values": pixels[None]}
        if self.mrope:
            return {
                "pixel_values": pixels,
                "image_grid_thw": torch.tensor([img.grid for img in images], dtype=torch.int64),
            }
        return {"pixel_values": pixels}

    def placed(self, feats: Sequence[Any]) -> Any:
        """``feats`` (per image, in order of appearance) as the model reads them for its
        ``mm_encoder_outputs``: ``pooler_output`` a tuple (Qwen, LLaVA concatenate it), a stacked
        tensor for Gemma-3; Qwen3-VL's also ``deepstack_features``, per layer a tuple per image
        (concatenated in the same order, so each lands on its own image's tokens)."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        output: Any = BaseModelOutputWithPooling  # per-image tuples where it types a tensor
        if self.kind in DEEPSTACK:
            from transformers.models.qwen3_vl import modeling_qwen3_vl

            output = modeling_qwen3_vl.BaseModelOutputWithDeepstackFeatures
            layers = len(feats[0][1]) if feats else 0
            deep = [tuple(f[1][k] for f in feats) for k in range(layers)]
            return output(pooler_output=tuple(f[0] for f in feats), deepstack_features=deep)
        out = torch.stack(list(feats)) if self.kind == "gemma3" else tuple(feats)  # per image
        return output(pooler_output=out)

    def extra(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Inputs beside the embeddings for rows ``input_ids`` ``[R, T]``: Gemma-3's
        ``token_type_ids`` (1 on image tokens, each row its own sequence), none otherwise."""
        if not self.token_types:
            return {}
        return {"token_type_ids": (input_ids == self.image_token).long()}  # [R, T]


def vision_model(model: Any) -> VisionModel | None:
    """The ``VisionModel`` of a served model, ``None`` for a text-only one; ``ConfigError`` for
    an image-text model that is not served (or whose class is not the served one)."""
    config: Any = getattr(model, "config", None)
    name = served_class(config, type(model).__name__)
    if name is None:
        return None
    kind = str(config.model_type)
    if type(model).__name__ not in (name, REWARD_SERVED.get(kind)):
        raise ConfigError(f"{type(model).__name__}: images are served through {name} only")
    video = getattr(config, "video_token_id", None) if kind in (*MROPE, "llava_onevision") else None
    vision = config.vision_config
    if kind in ("llava", *ANYRES) and config.vision_feature_select_strategy not in (
        "default",
        "full",
    ):
        raise ConfigError(
            f"{type(model).__name__}: vision_feature_select_strategy "
            f"{config.vision_feature_select_strategy!r} is not served ('default' or 'full')"
        )
    return VisionModel(
        model=model,
        kind=kind,
        image_token=int(config.image_token_id),
        video_token=int(video) if video is not None else None,
        merge=int(vision.spatial_merge_size) if kind in MROPE else 0,
        patch=int(vision.patch_size) if kind == "llava" else 0,
        fixed=_fixed(model, kind),
    )


def _fixed(model: Any, kind: str) -> int:
    """Gemma-3's ``mm_tokens_per_image``, SmolVLM's / Idefics3's ``image_seq_len``, else 0."""
    if kind == "gemma3":
        return int(model.config.mm_tokens_per_image)
    return int(model.model.image_seq_len) if kind in TILED else 0
