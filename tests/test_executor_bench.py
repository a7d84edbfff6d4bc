"""The benchmark's naive baseline computes the same numbers as the executor (fair comparison)."""

from __future__ import annotations

import numpy as np
import torch
from conftest_models import random_tokens, tiny_causal

from worker.bench import format_table, naive_logps, ragged_inputs
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor


def test_naive_baseline_agrees_with_executor() -> None:
    model = tiny_causal("llama")
    seqs = [SequenceInput(random_tokens(n, n), prompt_len=p) for n, p in ((20, 5), (9, 8), (14, 1))]
    ours = StatelessExecutor(ExecutorConfig(), model).score(seqs).scores
    with torch.inference_mode():  # the bench runs it so
        naive = naive_logps(model, seqs)
    for a, b in zip(naive, ours, strict=True):
        assert a.shape == b.logps.shape
        assert np.abs(a - b.logps).max() <= 1e-4


def test_ragged_inputs_are_deterministic_rl_shapes() -> None:
    a, b = ragged_inputs(quick=True), ragged_inputs(quick=True)
    assert [list(x.tokens) for x in a] == [list(x.tokens) for x in b]
    for s in a:
        assert 64 <= s.prompt_len <= 256 and 16 <= len(s.tokens) - s.prompt_len <= 1024


def test_table_lists_every_row() -> None:
    row = {"seconds": 1.0, "tokens_per_s": 10.0, "peak_extra_bytes": 2**20, "real_tokens": 10,
           "scored_tokens": 5}  # fmt: skip
    ratio = {"side": "ratio", "time_ratio": 0.3, "peak_memory_ratio": 0.1,
             "tokens_per_s_ratio": 3.0, "logps_agree": True, "met": True}  # fmt: skip
    doc = {"rows": {"x_naive": row, "x_ratio": ratio}, "meta": {"memory_method": "m"}}
    table = format_table(doc)
    assert "x_naive" in table and "x_ratio" in table and "time x0.300" in table
