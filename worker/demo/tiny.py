"""Tiny random transformers models, built from a config with a fixed seed: the one builder of
the demo, the tests, the benchmarks and the GPU check (the same seed and config give the same
weights, bit for bit).

:func:`random_model` builds any ``transformers`` class from a config after
``torch.manual_seed(seed)``; :func:`llama_config` is the Llama config they share;
:func:`tiny_config` / :func:`tiny_model` (``tiny_causal``, ``tiny_reward``, ``tiny_backbone``) are
the 2-layer models of the tests, in four architectures.

``save_tiny_models(DIR)`` (``scoring-worker demo --save-models DIR``) writes two random Llama
checkpoints that load like any other, each with the same byte-level tokenizer (UTF-8 bytes are
ids 3..258; ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2) and a chat template, so ``text`` and
``messages`` inputs work too:

* ``DIR/tiny-llama``: a ``LlamaForCausalLM`` (reference log-probs, teacher outputs);
* ``DIR/tiny-reward``: a ``LlamaForSequenceClassification`` with one label (rewards).

Their scores mean nothing (random weights, seed 0); they load in well under a second on a CPU,
which is what docs, tests and first tries need.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

BYTE_OFFSET = 3
"""Token id of byte 0 (ids 0-2 are ``<unk>``, ``<s>``, ``</s>``), as ``samples.ByteTokenizer``."""

VOCAB_SIZE = 256 + BYTE_OFFSET

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
"""A minimal chat template: each message as ``<s>role\\ncontent</s>\\n``."""


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet (each byte as one printable character), as byte-level BPE
    tokenizers spell bytes."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def byte_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` over UTF-8 bytes (no merges), with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab = {**specials, **{ch: b + BYTE_OFFSET for b, ch in _bytes_to_unicode().items()}}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def demo_config(**overrides: Any) -> Any:
    """The ``LlamaConfig`` of both checkpoints (2 layers, hidden 64, 4 heads, 2 KV heads)."""
    return llama_config(
        VOCAB_SIZE, 64, 128, 512, bos_token_id=1, eos_token_id=2, pad_token_id=0, **overrides
    )


def save_tiny_models(directory: str | Path) -> dict[str, Path]:
    """Write ``tiny-llama`` and ``tiny-reward`` under ``directory``; their paths by name."""
    root = Path(directory)
    tokenizer = byte_tokenizer()
    out = {"tiny-llama": root / "tiny-llama", "tiny-reward": root / "tiny-reward"}
    random_model("LlamaForCausalLM", demo_config(), 0).save_pretrained(out["tiny-llama"])
    reward = random_model("LlamaForSequenceClassification", demo_config(num_labels=1), 1)
    reward.save_pretrained(out["tiny-reward"])
    for path in out.values():
        tokenizer.save_pretrained(path)
    return out


# ----------------------------------------------------------------------------- the builder


def random_model(class_name: str, config: Any, seed: int, *, device: str | None = None) -> Any:
    """``transformers.<class_name>(config)`` with the weights drawn after
    ``torch.manual_seed(seed)`` (initialised on ``device`` when given), in eval mode."""
    import torch
    import transformers

    cls = getattr(transformers, class_name)
    torch.manual_seed(seed)
    if device is None:
        model = cls(config)
    else:
        with torch.device(device):
            model = cls(config)
    return model.eval()


def llama_config(
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    max_position_embeddings: int,
    *,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    **extra: Any,
) -> Any:
    """A ``LlamaConfig`` (2 layers, 4 heads, 2 KV heads unless told); ``extra`` as given."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        **extra,
    )


# ----------------------------------------------------------------------------- the tests' models

VOCAB = 96
"""The vocabulary of the tests' tiny models."""

ARCHS: tuple[str, ...] = ("llama", "qwen2", "gpt2", "mistral")
_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "gpt2": "GPT2", "mistral": "Mistral"}


def tiny_config(arch: str, *, vocab: int = VOCAB, init_range: float = 0.2, **extra: Any) -> Any:
    """A 2-layer config of ``arch`` small enough to build in milliseconds (``extra`` set on it
    after it is built)."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common: dict[str, Any] = {"vocab_size": vocab, "initializer_range": init_range}
    if arch == "gpt2":
        no_dropout: dict[str, Any] = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
        cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256, **no_dropout, **common)
    else:
        cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
        sizes = {"hidden_size": 32, "intermediate_size": 64, "max_position_embeddings": 256}
        heads = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
        cfg = cls(**sizes, **heads, tie_word_embeddings=False, **common)
    for key, value in extra.items():
        setattr(cfg, key, value)
    return cfg


def tiny_model(head: str, arch: str, seed: int, **extra: Any) -> Any:
    """A tiny random ``<Arch><head>`` (``head``: ``ForCausalLM``, ``ForSequenceClassification``,
    ``ForTokenClassification``, ``Model``; GPT-2's causal LM is ``GPT2LMHeadModel``)."""
    name = "GPT2LMHeadModel" if (arch, head) == ("gpt2", "ForCausalLM") else _PREFIX[arch] + head
    return random_model(name, tiny_config(arch, **extra), seed)


VLM_ARCHS: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
VLM_TOKENS = {"vision_start_token_id": 92, "vision_end_token_id": 93, "image_token_id": 94,
              "video_token_id": 95}  # fmt: skip
"""The placeholder ids of the tiny vision-language models (the top of ``VOCAB``; Gemma-3's
``boi``/``eoi`` are the start and end ids)."""
FIXED_VLM_ARCHS: tuple[str, ...] = ("llava", "gemma3", "smolvlm", "idefics3")
"""The tiny vision-language models with a fixed image-token count per image (16, 4, 4, 4)."""


def tiny_vlm(arch: str = "qwen2_vl", seed: int = 0) -> tuple[Any, Any]:
    """A tiny Qwen2-VL (``qwen2_vl``), Qwen2.5-VL (``qwen2_5_vl``), Qwen3-VL (``qwen3_vl``, two
    deepstack layers) or Qwen3-VL-MoE (``qwen3_vl_moe``, 4 experts) ``*ForConditionalGeneration``
    with random weights, and its image processor (PIL backend; images of 4 to 16 image tokens);
    ``llava`` / ``gemma3``: ``tiny_fixed_vlm``."""
    if arch in FIXED_VLM_ARCHS:
        return tiny_fixed_vlm(arch, seed)
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig, Qwen3VLMoeConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    text: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, "initializer_range": 0.2,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1],
                                "rope_theta": 10000.0}}  # fmt: skip
    vision: dict[str, Any] = {"depth": 1, "hidden_size": 32, "num_heads": 2, "patch_size": 14,
                              "spatial_merge_size": 2, "temporal_patch_size": 2}  # fmt: skip
    if arch == "qwen2_vl":
        cls, config = "Qwen2VLForConditionalGeneration", cast(Any, Qwen2VLConfig)
        vision.update(embed_dim=32, mlp_ratio=2)
    elif arch == "qwen2_5_vl":
        cls, config = "Qwen2_5_VLForConditionalGeneration", cast(Any, Qwen2_5_VLConfig)
        vision.update(intermediate_size=64, out_hidden_size=32, window_size=56,
                      fullatt_block_indexes=[0])  # fmt: skip
    elif arch in ("qwen3_vl", "qwen3_vl_moe"):
        moe = arch == "qwen3_vl_moe"
        cls = "Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"
        config = cast(Any, Qwen3VLMoeConfig if moe else Qwen3VLConfig)
        vision.update(depth=2, patch_size=16, intermediate_size=64, out_hidden_size=32,
                      num_position_embeddings=16, deepstack_visual_indexes=[0, 1])  # fmt: skip
        text.update(head_dim=8)
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
        if moe:
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    else:
        raise ValueError(f"unknown vision-language arch {arch!r}; expected one of {VLM_ARCHS}")
    model = random_model(cls, config(text_config=text, vision_config=vision, **VLM_TOKENS), seed)
    side = int(vision["patch_size"]) * 2  # one image token: merge 2 x 2 patches
    processor = Qwen2VLImageProcessorPil(
        patch_size=vision["patch_size"], min_pixels=side * side * 4, max_pixels=side * side * 16
    )
    return model, processor


def tiny_fixed_vlm(arch: str = "llava", seed: int = 0) -> tuple[Any, Any]:
    """A tiny LLaVA (a CLIP tower on 28 x 28 images of 7 x 7 patches: 16 image tokens) or
    Gemma-3 (a SigLIP tower pooled to ``mm_tokens_per_image`` 4) with random weights and its
    image processor (PIL backend); SmolVLM or Idefics3 (a SigLIP tower on 28 x 28 images, pixel
    shuffle by 2: ``image_seq_len`` 4, image splitting off)."""
    from transformers import Gemma3Config, Idefics3Config, LlavaConfig, SmolVLMConfig
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
    vision = {**sizes, "num_hidden_layers": 2, "image_size": 28, "patch_size": 7}
    text: dict[str, Any] = {"vocab_size": VOCAB, **sizes, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2,
                            "max_position_embeddings": 512, "initializer_range": 0.2}  # fmt: skip
    if arch == "llava":
        config: Any = LlavaConfig(text_config={"model_type": "llama", **text},
                                  vision_config=vision,
                                  image_token_index=VLM_TOKENS["image_token_id"])  # fmt: skip
        processor: Any = CLIPImageProcessorPil(
            size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
        )
        return random_model("LlavaForConditionalGeneration", config, seed), processor
    if arch in ("smolvlm", "idefics3"):
        smol = arch == "smolvlm"
        tiled: Any = (SmolVLMConfig if smol else Idefics3Config)(
            text_config={"model_type": "llama", **text}, vision_config=vision, scale_factor=2,
            image_token_id=VLM_TOKENS["image_token_id"],
        )  # fmt: skip
        return random_model(
            "SmolVLMForConditionalGeneration" if smol else "Idefics3ForConditionalGeneration",
            tiled,
            seed,
        ), _tiled_processor(smol)
    if arch != "gemma3":
        raise ValueError(
            f"unknown vision-language arch {arch!r}; expected one of {FIXED_VLM_ARCHS}"
        )
    text.update(
        head_dim=8,
        sliding_window=8,
        query_pre_attn_scalar=8,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4,
        image_token_index=VLM_TOKENS["image_token_id"],
        boi_token_index=VLM_TOKENS["vision_start_token_id"],
        eoi_token_index=VLM_TOKENS["vision_end_token_id"],
    )  # fmt: skip
    processor = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    return random_model("Gemma3ForConditionalGeneration", config, seed), processor


def tiny_vlm_reward(seed: int = 1) -> tuple[Any, Any]:
    """A tiny random ``Gemma3ForSequenceClassification`` (``tiny_fixed_vlm("gemma3")``'s
    config, one label, pad id 0) and its image processor."""
    model, processor = tiny_fixed_vlm("gemma3", seed)
    config = model.config
    config.num_labels, config.pad_token_id, config.text_config.pad_token_id = 1, 0, 0
    return random_model("Gemma3ForSequenceClassification", config, seed), processor


def save_tiny_vlm_reward(directory: str | Path, seed: int = 1) -> Path:
    """``tiny_vlm_reward`` saved with ``save_pretrained`` (model and its image processor)."""
    model, processor = tiny_vlm_reward(seed)
    path = Path(directory)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def _tiled_processor(smol: bool) -> Any:
    """SmolVLM's or Idefics3's image processor (PIL) for 28 x 28 images, image splitting off."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )
    from transformers.models.smolvlm.image_processing_pil_smolvlm import (
        SmolVLMImageProcessorPil,
    )

    cls = SmolVLMImageProcessorPil if smol else Idefics3ImageProcessorPil
    side = {"longest_edge": 28}
    return cls(do_image_splitting=False, size=side, max_image_size=side)


def save_tiny_vlm(directory: str | Path, arch: str = "qwen2_vl", seed: int = 0) -> Path:
    """``tiny_vlm`` saved with ``save_pretrained`` (model and ``preprocessor_config.json``)."""
    model, processor = tiny_vlm(arch, seed)
    path = Path(directory)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def tiny_causal(arch: str = "llama", seed: int = 0, **extra: Any) -> Any:
    """A tiny random ``*ForCausalLM`` (GPT-2: ``GPT2LMHeadModel``), eval mode, float32."""
    return tiny_model("ForCausalLM", arch, seed, **extra)


def tiny_reward(arch: str = "llama", seed: int = 1, **extra: Any) -> Any:
    """A tiny random ``*ForSequenceClassification`` with ``num_labels=1``, pad == eos == 0."""
    extra.setdefault("num_labels", 1)
    extra.setdefault("pad_token_id", 0)
    extra.setdefault("eos_token_id", 0)
    return tiny_model("ForSequenceClassification", arch, seed, **extra)


def tiny_backbone(arch: str = "llama", seed: int = 2) -> Any:
    """A tiny bare ``*Model`` (no head), for value-head adapters."""
    return tiny_model("Model", arch, seed)


__all__ = [
    "ARCHS",
    "CHAT_TEMPLATE",
    "FIXED_VLM_ARCHS",
    "VOCAB",
    "VOCAB_SIZE",
    "byte_tokenizer",
    "demo_config",
    "llama_config",
    "random_model",
    "save_tiny_models",
    "save_tiny_vlm",
    "tiny_backbone",
    "tiny_causal",
    "tiny_config",
    "tiny_fixed_vlm",
    "tiny_model",
    "tiny_reward",
    "tiny_vlm",
]
