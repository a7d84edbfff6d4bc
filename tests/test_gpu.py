"""CUDA paths of the executor: bf16 scoring, flash-attention fallback, per-batch peak memory and the
real out-of-memory split. Marked ``gpu``: skipped without CUDA (CI has none); run them on a GPU
machine with ``make test-gpu``.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from tests.support.models import random_tokens, tiny_causal
from worker.errors import TooLong
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _seqs(n: int, length: int, prompt: int, vocab: int = 96) -> list[SequenceInput]:
    return [SequenceInput(random_tokens(length, i, vocab), prompt_len=prompt) for i in range(n)]


def test_cuda_bf16_matches_cpu_fp32_and_reports_cuda_peaks() -> None:
    seqs = _seqs(6, 120, 40)
    cpu = StatelessExecutor(ExecutorConfig(), tiny_causal("llama")).score(seqs)
    ex = StatelessExecutor(ExecutorConfig(device="cuda", dtype="bfloat16"), tiny_causal("llama"))
    out = ex.score(seqs)
    for a, b in zip(cpu.scores, out.scores, strict=True):
        assert a.logps is not None and b.logps is not None and b.logps.dtype == np.float32
        assert np.allclose(a.logps, b.logps, atol=0.1)  # bf16 weights vs fp32
    m = out.metrics
    assert m.peak_allocated_bytes > 0 and m.peak_reserved_bytes >= m.peak_allocated_bytes
    assert m.device_total_bytes == torch.cuda.get_device_properties(0).total_memory
    assert ex.info["device"].startswith("cuda")


def test_flash_attention_2_is_used_or_falls_back_with_a_reason() -> None:
    ex = StatelessExecutor(
        ExecutorConfig(device="cuda", dtype="bfloat16", attention_backend="flash_attention_2"),
        tiny_causal("llama"),
    )
    if importlib.util.find_spec("flash_attn") is None:
        assert ex.attention_backend == "sdpa"
        assert ex.load_fallbacks and ex.load_fallbacks[0].reason == "not_installed"
    else:
        assert ex.attention_backend == "flash_attention_2"
        # Packed varlen flash must agree with padded sdpa on the same model.
        seqs = _seqs(8, 200, 50)
        packed = ex.score(seqs)
        assert packed.metrics.packed and packed.metrics.padded_tokens == 0
        sdpa_cfg = ExecutorConfig(
            device="cuda", dtype="bfloat16", attention_backend="sdpa", packing="padded"
        )
        padded = StatelessExecutor(sdpa_cfg, tiny_causal("llama")).score(seqs)  # same seed
        for a, b in zip(packed.scores, padded.scores, strict=True):
            assert np.allclose(a.logps, b.logps, atol=0.05)


def test_real_cuda_oom_splits_the_batch_and_a_lone_giant_is_too_long() -> None:
    """With the allocator capped, a 128k-vocab LM head over many scored tokens at once OOMs."""
    vocab = 128_256
    model = tiny_causal("llama", vocab=vocab)
    _free, total = torch.cuda.mem_get_info()
    cap_bytes = 1_500 * 2**20  # 1.5 GiB
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total))
    try:
        # chunk = whole scored set, so the [scored, vocab] fp32 block grows with the batch:
        # 8 x 600 scored -> ~2.3 GiB (OOM), halves of 2 x 600 -> ~0.6 GiB (fit).
        cfg = ExecutorConfig(
            device="cuda",
            dtype="float32",
            logprob_chunk_tokens=1 << 20,
            max_batch_tokens=1 << 20,
            packing="padded",
        )
        ex = StatelessExecutor(cfg, model)
        seqs = _seqs(8, 640, 40, vocab)
        out = ex.score(seqs)
        assert out.metrics.oom_splits >= 1
        assert all(s.error is None and s.logps is not None for s in out.scores)
        giant = ex.score([SequenceInput(random_tokens(4000, 99, vocab), prompt_len=1)])
        assert isinstance(giant.scores[0].error, TooLong)
        assert ex.score(seqs[:1]).scores[0].error is None  # still serving after the OOM
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
