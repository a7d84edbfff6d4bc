"""Which vision-language models are served, and what the executor needs to know of one.

Served exactly: Qwen2-VL and Qwen2.5-VL (``*ForConditionalGeneration``), whose positions are
3-row mRoPE computed by the model's own ``get_rope_index``. Any other model with a vision tower
(a config with ``vision_config``: Gemma-3, Idefics3, LLaVA, Mistral-3, Qwen3-VL, ...) is refused
at load with its class named: its positions, token types or feature placement differ, and a
forward that ran anyway would be silently wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.errors import ConfigError

SERVED: dict[str, str] = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}
"""model_type -> the class served for it."""


def has_vision(config: Any) -> bool:
    """Whether a transformers config describes a model with a vision tower."""
    return getattr(config, "vision_config", None) is not None


def served_class(config: Any, loaded: str | None = None) -> str | None:
    """The class to load a checkpoint's ``config`` with: ``None`` for a text-only model, the
    served class of a Qwen2-VL / Qwen2.5-VL; ``ConfigError`` naming the class (``loaded``, the
    checkpoint's architecture, or transformers' image-text class of its ``model_type``) for
    any other image-text model."""
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

    ``model``: the ``*ForConditionalGeneration``; ``image_token``, ``video_token``: the
    placeholder ids; ``merge``: the vision tower's spatial merge size (an image of grid
    ``t x h x w`` patches is ``t*h*w / merge**2`` image tokens)."""

    model: Any
    image_token: int
    video_token: int | None
    merge: int

    @property
    def name(self) -> str:
        """The model's class name."""
        return type(self.model).__name__


def vision_model(model: Any) -> VisionModel | None:
    """The ``VisionModel`` of a served model, ``None`` for a text-only one; ``ConfigError`` for
    an image-text model that is not served (or whose class is not the served one)."""
    config: Any = getattr(model, "config", None)
    name = served_class(config, type(model).__name__)
    if name is None:
        return None
    if type(model).__name__ != name:
        raise ConfigError(f"{type(model).__name__}: images are served through {name} only")
    video = getattr(config, "video_token_id", None)
    return VisionModel(
        model=model,
        image_token=int(config.image_token_id),
        video_token=int(video) if video is not None else None,
        merge=int(config.vision_config.spatial_merge_size),
    )
