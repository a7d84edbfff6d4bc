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
- SmolVLM, Idefics3: ``image_seq_len`` tokens per image (one run, between the processor's
  ``<fake_token_around_image><global-img>`` and ``<fake_token_around_image>``), 1-D positions;
  served with ``do_image_splitting`` off only (its tiles would add a run per tile per image).

Any other model with a vision tower (a config with ``vision_config``: LLaVA-NeXT,
LLaVA-OneVision, Mistral-3, ...) is refused at load with its class named: its
positions, token types or feature placement differ, and a forward that ran anyway would be
silently wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from worker.errors import BadRequest, ConfigError

SERVED: dict[str, str] = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "smolvlm": "SmolVLMForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
}
"""model_type -> the class served for it."""

MROPE = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
"""The served model types with 3-row mRoPE positions (the others' are ``0 .. L-1``)."""
TILED = ("smolvlm", "idefics3")
"""The served model types whose processor lays an image out as tiles of ``image_seq_len`` tokens
(served with one tile per image: ``do_image_splitting`` off)."""
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

    def count(self, out: Any) -> tuple[tuple[int, int, int], int]:
        """``(grid, tokens)`` of one image from the processor's output ``out`` (numpy): Qwen's
        ``image_grid_thw`` and ``t*h*w / merge**2``; LLaVA's patch grid ``(1, h, w)`` and
        ``h*w`` (+1 with strategy ``full``); Gemma-3's pixel shape and ``mm_tokens_per_image``."""
        if self.mrope:
            t, h, w = (int(x) for x in np.asarray(out["image_grid_thw"])[0])
            return (t, h, w), t * h * w // (self.merge * self.merge)
        if self.kind in TILED:  # pixel_values [1, tiles, 3, H, W]
            _, n, _, height, width = np.asarray(out["pixel_values"]).shape
            if not np.asarray(out["pixel_attention_mask"]).all():
                raise BadRequest(f"{self.name}: a padded image tile is not served")
            return (int(n), int(height), int(width)), int(n) * self.fixed
        n, _, height, width = np.asarray(out["pixel_values"]).shape
        if self.kind == "llava":
            h, w = height // self.patch, width // self.patch
            full = self.model.config.vision_feature_select_strategy == "full"
            return (int(n), h, w), int(n) * (h * w + int(full))
        return (int(n), int(height), int(width)), int(n) * self.fixed

    def describe(self, grid: tuple[int, int, int]) -> str:
        """How the token count of an image of ``grid`` comes about (``bad_request`` text)."""
        if self.mrope:
            return f"grid {grid}, merge {self.merge}"
        if self.kind == "llava":
            return f"patch grid {grid[1]}x{grid[2]} of patch {self.patch}"
        if self.kind in TILED:
            return f"{grid[0]} tile(s) of image_seq_len {self.fixed}"
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
        out = torch.stack(list(feats)) if self.kind == "gemma3" else tuple(feats)
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
    if type(model).__name__ != name:
        raise ConfigError(f"{type(model).__name__}: images are served through {name} only")
    kind = str(config.model_type)
    video = getattr(config, "video_token_id", None) if kind in MROPE else None
    vision = config.vision_config
    if kind == "llava" and config.vision_feature_select_strategy not in ("default", "full"):
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
