"""``flex_attention`` on a CPU: torch's uncompiled math, never the compiled CPU kernel, exact at
every length (``worker.executor.flex``).

torch 2.13's compiled CPU flex kernel is wrong on CPUs without AVX-512 for key lengths that are
odd multiples of 8; the lengths below include 8, 24 and 40, so the first test fails there when
the compiled kernel runs, and the second fails on every CPU."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.models import tiny_variant
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor

LENGTHS = (7, 8, 9, 16, 24, 33, 40)
VOCAB = 96


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_variant("llama")


def _seqs() -> list[SequenceInput]:
    rng = np.random.default_rng(5)
    return [SequenceInput(rng.integers(3, VOCAB, n).tolist(), prompt_len=2) for n in LENGTHS]


def _logps(model: torch.nn.Module, backend: str, layout: str) -> list[np.ndarray]:
    ex = StatelessExecutor(
        ExecutorConfig(
            attention_backend=backend,  # type: ignore[arg-type]
            prefix_sharing="off",
            self_check=False,
            packing=layout,  # type: ignore[arg-type]
        ),
        model,
    )
    assert ex.attention_backend == backend
    out = ex.score(_seqs(), temperature=0.7)
    ex.close()
    assert out.metrics.backend == backend and not out.metrics.fallbacks  # no run-time fallback
    return [np.asarray(s.logps) for s in out.scores]


@pytest.fixture
def no_compiled_flex(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any call of transformers' compiled flex attention fails the test."""
    from transformers.integrations import flex_attention as hf_flex

    def compiled(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the compiled flex kernel ran on a CPU")

    monkeypatch.setattr(hf_flex.WrappedFlexAttention, "__call__", lambda self: compiled)
    yield


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_flex_per_sequence_equals_sdpa_at_every_length(
    model: torch.nn.Module, layout: str, no_compiled_flex: None
) -> None:
    """Every sequence alone (padded buckets) and packed rows on ``flex_attention`` give SDPA's
    log-probs, at lengths that are odd multiples of 8 too, without the compiled kernel."""
    want = _logps(model, "sdpa", layout)
    got = _logps(model, "flex_attention", layout)
    for n, x, y in zip(LENGTHS, got, want, strict=True):
        assert np.isfinite(x).all(), n
        np.testing.assert_allclose(x, y, rtol=0, atol=2e-5, err_msg=f"length {n}")


def test_flex_reads_no_unwritten_memory(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every fresh tensor filled with NaN before use (torch's deterministic mode fills
    uninitialised memory), the flex forward still equals SDPA: no value comes from memory read
    before it was written."""
    want = _logps(model, "sdpa", "padded")
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        got = _logps(model, "flex_attention", "padded")
    finally:
        torch.use_deterministic_algorithms(before)
    for n, x, y in zip(LENGTHS, got, want, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=2e-5, err_msg=f"length {n}")


def test_install_routes_cpu_calls_and_keeps_the_compiled_kernel_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``install`` is idempotent; a CPU tensor runs the eager math, any other device the
    function transformers had (its compiled kernel)."""
    from transformers.integrations import flex_attention as hf_flex

    from worker.executor import flex

    seen: list[str] = []

    def compiled(query: torch.Tensor, *args: Any, **kwargs: Any) -> str:
        seen.append(str(kwargs.get("training")))
        return "compiled"

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", compiled)
    assert not flex.installed()
    flex.install()
    flex.install()
    routed = hf_flex.compile_friendly_flex_attention
    assert flex.installed() and routed.__wrapped__ is compiled  # type: ignore[attr-defined]
    q = torch.randn(1, 2, 8, 4)
    out = routed(q, q, q, training=False)
    torch.testing.assert_close(
        out, torch.nn.functional.scaled_dot_product_attention(q, q, q), rtol=0, atol=1e-6
    )
    meta = torch.empty(1, 2, 8, 4, device="meta")
    assert routed(meta, meta, meta, training=True) == "compiled" and seen == ["True"]
