"""What the LLaVA-NeXT, LLaVA-OneVision, Mistral-3 and split SmolVLM / Idefics3 image tests
share: tiny models built from configs (fixed seed, no hub) with their image processors, the
placeholders as each model's own processor writes them (from that processor's output), and the
naive reference (each sequence alone through transformers with its processor's output for its
images, positions ``0 .. L-1``)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from tests.support.vision import END, IMAGE, START
from worker.demo.tiny import VLM_TOKENS, VOCAB, random_model, tiny_fixed_vlm

MORE_VLM_ARCHS = ("llava_next", "llava_onevision", "mistral3", "smolvlm_split", "idefics3_split")
"""The tiny models of this module (``*_split``: SmolVLM / Idefics3 with image splitting on)."""
BREAK, ROW = 90, 91  # Mistral-3's [IMG_BREAK] (its [IMG_END] is END); SmolVLM's <row_r_col_c>
PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]

_SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
_TEXT: dict[str, Any] = {"vocab_size": VOCAB, **_SIZES, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2,
                         "max_position_embeddings": 512, "initializer_range": 0.2}  # fmt: skip


def tiny_more_vlm(arch: str, seed: int = 0) -> tuple[Any, Any]:
    """A tiny ``arch`` (``MORE_VLM_ARCHS``) with random weights and its image processor (PIL):
    LLaVA-NeXT (CLIP, 28 x 28 views of 4 x 4 patches, strategy ``default``), LLaVA-OneVision
    (SigLIP, strategy ``full``, ``anyres_max_1`` so large grids are shrunk), Mistral-3 (a
    Pixtral tower of patch 7, merge 2, images up to 56 pixels a side), SmolVLM / Idefics3 with
    image splitting on (tiles of 28, images up to 84 a side)."""
    from transformers import LlavaNextConfig, LlavaOnevisionConfig, Mistral3Config

    image = VLM_TOKENS["image_token_id"]
    vision = {**_SIZES, "num_hidden_layers": 2, "image_size": 28, "patch_size": 7}
    if arch in ("smolvlm_split", "idefics3_split"):
        model, _ = tiny_fixed_vlm(arch.removesuffix("_split"), seed)
        return model, split_processor(arch == "smolvlm_split")
    if arch == "llava_next":
        from transformers.models.llava_next.image_processing_pil_llava_next import (
            LlavaNextImageProcessorPil,
        )

        config: Any = LlavaNextConfig(
            text_config={"model_type": "llama", **_TEXT}, vision_config=vision,
            image_token_index=image, image_grid_pinpoints=PINPOINTS,
        )  # fmt: skip
        processor: Any = LlavaNextImageProcessorPil(
            size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
            image_grid_pinpoints=PINPOINTS,
        )  # fmt: skip
        return random_model("LlavaNextForConditionalGeneration", config, seed), processor
    if arch == "llava_onevision":
        from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
            LlavaOnevisionImageProcessorPil,
        )

        config = LlavaOnevisionConfig(
            text_config={"model_type": "qwen2", **_TEXT},
            vision_config={"model_type": "siglip_vision_model", **vision},
            image_token_index=image, video_token_index=VLM_TOKENS["video_token_id"],
            image_grid_pinpoints=PINPOINTS, vision_aspect_ratio="anyres_max_1",
            vision_feature_select_strategy="full", vision_feature_layer=-1,
        )  # fmt: skip
        processor = LlavaOnevisionImageProcessorPil(
            size={"height": 28, "width": 28}, image_grid_pinpoints=PINPOINTS
        )
        return random_model("LlavaOnevisionForConditionalGeneration", config, seed), processor
    if arch != "mistral3":
        raise ValueError(f"unknown arch {arch!r}; expected one of {MORE_VLM_ARCHS}")
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    config = Mistral3Config(
        text_config={"model_type": "mistral", **_TEXT, "head_dim": 8},
        vision_config={"model_type": "pixtral", **vision, "image_size": 56, "head_dim": 16},
        image_token_index=image, spatial_merge_size=2, vision_feature_layer=-1,
    )  # fmt: skip
    processor = PixtralImageProcessorPil(
        size={"longest_edge": 56}, patch_size={"height": 7, "width": 7}
    )
    return random_model("Mistral3ForConditionalGeneration", config, seed), processor


def split_processor(smol: bool) -> Any:
    """SmolVLM's or Idefics3's image processor (PIL) with image splitting on: tiles of 28, an
    image resized to at most 84 a side."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )
    from transformers.models.smolvlm.image_processing_pil_smolvlm import (
        SmolVLMImageProcessorPil,
    )

    cls = SmolVLMImageProcessorPil if smol else Idefics3ImageProcessorPil
    return cls(do_image_splitting=True, size={"longest_edge": 84},
               max_image_size={"longest_edge": 28})  # fmt: skip


def save_more_vlm(directory: str | Path, arch: str, seed: int = 0) -> Path:
    """``tiny_more_vlm`` saved with ``save_pretrained`` (model and ``preprocessor_config.json``)."""
    model, processor = tiny_more_vlm(arch, seed)
    path = Path(directory)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def processed(model: Any, processor: Any, files: Sequence[bytes]) -> Any:
    """The image processor's output for ``files`` (decoded as the worker does) as the model's
    own processor calls it (Mistral-3's ``patch_size`` of patch x merge), torch tensors."""
    images = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    extra: dict[str, Any] = {}
    if model.config.model_type == "mistral3":
        side = model.config.vision_config.patch_size * model.config.spatial_merge_size
        extra["patch_size"] = {"height": side, "width": side}
    if model.config.model_type in ("smolvlm", "idefics3"):
        extra["return_row_col_info"] = True  # as their processors call it
    return processor(images=images, return_tensors="pt", **extra)


def placeholder(model: Any, processor: Any, data: bytes) -> list[int]:
    """One image's tokens as its model's own processor writes them, from the image processor's
    output: LLaVA-NeXT's / OneVision's ``n`` image tokens (``n`` from the image's size, as
    ``LlavaNextProcessor._get_number_of_features`` counts it); Mistral-3's rows of image tokens,
    each closed by ``[IMG_BREAK]`` but the last, closed by ``[IMG_END]``; SmolVLM's tiles (each
    ``<fake_token_around_image><row_r_col_c>``, ``image_seq_len`` image tokens), then the
    global image (``<fake_token_around_image><global-img>``, image tokens,
    ``<fake_token_around_image>``); the tiny ids stand for the special tokens."""
    out = processed(model, processor, [data])
    kind = model.config.model_type
    if kind == "mistral3":
        side = model.config.vision_config.patch_size * model.config.spatial_merge_size
        h, w = (int(x) // side for x in out["image_sizes"][0])
        tokens = [t for _ in range(h) for t in [*[IMAGE] * w, BREAK]]
        return [*tokens[:-1], END]
    if kind in ("smolvlm", "idefics3"):
        seq = int(model.model.image_seq_len)
        rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        tiles = [t for _ in range(rows * cols) for t in [START, ROW, *[IMAGE] * seq]]
        return [*tiles, START, END, *[IMAGE] * seq, START]
    return [IMAGE] * anyres_count(model, processor, out)


def anyres_count(model: Any, processor: Any, out: Any) -> int:
    """The image tokens ``LlavaNextProcessor`` / ``LlavaOnevisionProcessor`` write for the one
    image of ``out`` (their ``_get_number_of_features``, on a processor built around the image
    processor)."""
    import transformers

    name = (
        "LlavaNextProcessor"
        if model.config.model_type == "llava_next"
        else "LlavaOnevisionProcessor"
    )
    cls = getattr(transformers, name)
    proc = cls.__new__(cls)  # the counting methods read only these attributes
    proc.image_processor = processor
    vision = model.config.vision_config
    proc.patch_size = vision.patch_size
    proc.num_image_tokens = (vision.image_size // vision.patch_size) ** 2
    proc.num_additional_image_tokens = 1  # CLIP's CLS (LLaVA-NeXT)
    proc.vision_feature_select_strategy = model.config.vision_feature_select_strategy
    proc.vision_aspect_ratio = getattr(model.config, "vision_aspect_ratio", None)
    h, w = (int(x) for x in out["image_sizes"][0])
    side = int(out["pixel_values"].shape[-1])
    n = proc._get_number_of_features(h, w, side, side)
    if model.config.model_type == "llava_next" and proc.vision_feature_select_strategy == "default":
        n -= 1  # LlavaNextProcessor counts CLS in its base then drops it
    return int(n)


def more_reference(
    model: Any, processor: Any, files: Sequence[bytes], tokens: Sequence[int],
    refs: Sequence[int], *, temperature: float = 1.0, topk: int = 0,
) -> dict[str, np.ndarray]:  # fmt: skip
    """Per position ``t >= 1``: ``logps``, ``entropy`` and, with ``topk``, ``topk_ids`` /
    ``topk_logps`` from one forward of the sequence alone with its images (``files[r]`` for
    ``r`` in ``refs``, through the image processor as one flat list)."""
    ids = torch.tensor([list(tokens)])
    extra: dict[str, Any] = {"position_ids": torch.arange(ids.shape[1])[None]}
    if refs:
        out = processed(model, processor, [files[r] for r in refs])
        for key in ("pixel_values", "image_sizes", "pixel_attention_mask", "batch_num_images"):
            if key in out:
                extra[key] = out[key]
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
