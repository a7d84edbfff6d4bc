"""CUDA paths of the executor: bf16 scoring, flash-attention fallback, per-batch peak memory, the
real out-of-memory split, and an OOM's failed forward freed before its halves run. Marked
``gpu``: skipped without CUDA (CI has none); run them on a GPU machine with ``make test-gpu`` or
the GPU check (``python3 -m worker.devtools.gpu_check --out DIR``, docs/gpu-check.md).
"""

from __future__ import annotations

import gc
import importlib.util

import numpy as np
import pytest
import torch

from tests.support.models import (
    BF16_LOGP_MAX_ABS,
    BF16_LOGP_MEAN_ABS,
    random_tokens,
    tiny_causal,
)
from tests.support.oom import SimulatedCap
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
        error = np.abs(a.logps - b.logps)  # bf16 weights vs fp32: bounds measured, see models.py
        assert error.max() <= BF16_LOGP_MAX_ABS and error.mean() <= BF16_LOGP_MEAN_ABS, error
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


OOM_VOCAB = 128_256
OOM_POSITIONS = 8192
OOM_CAP_FRACTION = 0.4


def test_real_cuda_oom_splits_the_batch_and_a_lone_giant_is_too_long() -> None:
    """The LM head over every scored token in one block (``[scored, V]`` float32, V = 128,256)
    is what grows with the batch: 16 x 240 scored rows, about 1.9 GiB. The cap is measured: the
    weights plus 40% of the uncapped run's extra, so the whole batch cannot fit (nor its halves,
    about 50%); a lone sequence of twice the batch's scored rows cannot fit at all. Every length
    is within the model's positions, so nothing is ``TooLong`` before the GPU runs."""
    model = tiny_causal("llama", vocab=OOM_VOCAB, max_position_embeddings=OOM_POSITIONS)
    cfg = ExecutorConfig(
        device="cuda",
        dtype="float32",
        logprob_chunk_tokens=1 << 20,
        logprob_chunk_bytes=1 << 40,  # no byte budget: one block for the whole batch
        max_batch_tokens=1 << 20,
        packing="padded",
    )
    ex = StatelessExecutor(cfg, model)
    seqs = _seqs(16, 250, 10, OOM_VOCAB)
    giant = [SequenceInput(random_tokens(7_681, 99, OOM_VOCAB), prompt_len=1)]  # 7,680 scored
    assert ex.max_positions is not None and len(giant[0].tokens) <= ex.max_positions
    ex.score(seqs[:2])  # warm-up
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    free = ex.score(seqs)
    assert free.metrics.oom_splits == 0 and all(s.error is None for s in free.scores)
    extra = free.metrics.peak_allocated_bytes - base
    assert extra > 16 * 240 * OOM_VOCAB * 4  # the one block is in it
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction((base + OOM_CAP_FRACTION * extra) / total)
    try:
        out = ex.score(seqs)
        assert out.metrics.oom_splits >= 1
        for a, b in zip(out.scores, free.scores, strict=True):
            assert a.error is None and a.logps is not None and b.logps is not None
            assert np.abs(a.logps - b.logps).max() <= 1e-4
        lone = ex.score(giant)
        assert isinstance(lone.scores[0].error, TooLong), lone.scores[0].error
        assert ex.score(seqs[:1]).scores[0].error is None  # still serving after the OOM
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_a_cuda_oom_frees_the_failed_forward_before_its_halves_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fake OOM in the last layer's MLP (``tests/support/oom.py``, as in
    ``tests/executor/test_oom.py``), on the GPU: each attempt starts with no more memory
    allocated than the first did, so nothing of a failed forward (each of its hidden-state
    tensors alone is 256 KiB, and a failed attempt holds about ten) was still held when its
    halves ran. The slack, one such tensor, is for what a new shape may allocate once."""
    rows, tokens, fit_rows = 8, 250, 2
    seqs = _seqs(rows, tokens, 10)
    model = tiny_causal("llama", seed=0)
    ex = StatelessExecutor(ExecutorConfig(device="cuda", dtype="float32", packing="padded"), model)
    clean = ex.score(seqs)  # the same shapes once: lazily built caches exist before the probe
    cap = SimulatedCap(model, cap_slots=fit_rows * tokens, probe=torch.cuda.memory_allocated)
    cap.install(monkeypatch)
    out = ex.score(seqs)
    assert cap.alive_at_start == [0] * len(cap.attempts), cap.alive_at_start
    first = cap.probed_at_start[0]
    assert all(p <= first + 256 * 2**10 for p in cap.probed_at_start), cap.probed_at_start
    assert out.metrics.oom_splits == 3 and cap.attempts == [8, 4, 2, 2, 4, 2, 2]
    for a, b in zip(out.scores, clean.scores, strict=True):
        assert a.error is None and np.abs(a.logps - b.logps).max() <= 1e-5
