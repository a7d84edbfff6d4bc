"""Device OOM: split the batch in halves and retry; a lone sequence that still OOMs -> TooLong.

The second test raises the OOM deep inside the model (the last layer's MLP) under a simulated
memory cap that also counts what earlier failed attempts still hold alive
(``tests/support/oom.py``), so it fails when the recovery runs inside the ``except`` block
(whose traceback keeps every frame of the failed forward, and so its tensors, alive while the
halves run).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.models import random_tokens, tiny_causal
from tests.support.oom import SimulatedCap
from worker.errors import TooLong
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor


def _oom_above(model: Any, max_tokens: int) -> list[int]:
    """Make the backbone raise torch.OutOfMemoryError on forwards above ``max_tokens`` slots."""
    backbone = model.model
    original = backbone.forward
    sizes: list[int] = []

    def forward(*args: Any, **kwargs: Any) -> Any:
        n = kwargs["input_ids"].numel()
        sizes.append(n)
        if n > max_tokens:
            raise torch.OutOfMemoryError(f"simulated OOM at {n} tokens")
        return original(*args, **kwargs)

    backbone.forward = forward
    return sizes


def test_oom_splits_in_halves_and_marks_too_long() -> None:
    model = tiny_causal("llama")
    seqs = [
        SequenceInput(random_tokens(n, i), prompt_len=1)
        for i, n in enumerate((10, 40, 12, 9, 11, 8))
    ]
    ex = StatelessExecutor(ExecutorConfig(packing="packed"), model)
    clean = ex.score(seqs)
    sizes = _oom_above(model, 30)
    out = ex.score(seqs)
    assert out.metrics.oom_splits >= 2
    assert sizes[0] == sum(len(s.tokens) for s in seqs)  # first the whole packed row
    # every other sequence ran exactly once, in forwards that fit
    assert sum(n for n in sizes if n <= 30) == sum(len(s.tokens) for s in seqs) - 40
    for i, (a, b) in enumerate(zip(out.scores, clean.scores, strict=True)):
        if i == 1:  # the 40-token sequence cannot fit even alone
            assert isinstance(a.error, TooLong) and a.error.code == "too_long"
            assert a.logps is None and a.reward is None
        else:
            assert a.error is None
            assert np.abs(a.logps - b.logps).max() <= 1e-5


def test_a_failed_attempt_is_freed_before_its_halves_run_and_splits_are_minimal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows, tokens, fit_rows = 8, 16, 2
    seqs = [SequenceInput(random_tokens(tokens, i), prompt_len=4) for i in range(rows)]
    model = tiny_causal("llama", seed=0)
    ex = StatelessExecutor(ExecutorConfig(packing="padded"), model)
    clean = ex.score(seqs)
    cap = SimulatedCap(model, cap_slots=fit_rows * tokens)
    cap.install(monkeypatch)

    out = ex.score(seqs)

    assert cap.failed and all(f.refs for f in cap.failed)  # the frames held tensors then
    # Every tensor of a failed attempt was gone before the next attempt began.
    assert cap.alive_at_start == [0] * len(cap.attempts), cap.alive_at_start
    # 8 rows -> 4 + 4 -> 2 + 2 + 2 + 2: the fewest halvings that reach batches that fit.
    leaves = 2 ** math.ceil(math.log2(rows / fit_rows))
    assert out.metrics.oom_splits == leaves - 1 == 3
    assert cap.attempts == [8, 4, 2, 2, 4, 2, 2]
    assert [f.rows for f in cap.failed] == [8, 4, 4]
    for a, b in zip(out.scores, clean.scores, strict=True):
        assert a.error is None and a.logps is not None
        assert np.abs(a.logps - b.logps).max() <= 1e-5
