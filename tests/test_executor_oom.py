"""Device OOM: split the batch in halves and retry; a lone sequence that still OOMs -> TooLong."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tests.support.models import random_tokens, tiny_causal
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
    seqs = [SequenceInput(random_tokens(n, i), prompt_len=1) for i, n in
            enumerate((10, 40, 12, 9, 11, 8))]  # fmt: skip
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
