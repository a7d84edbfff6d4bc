"""Executor log-probs equal the naive float64 log_softmax(logits / T).gather on tiny models."""

from __future__ import annotations

import array
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.support.models import ARCHS, random_tokens, tiny_causal
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor

LENGTHS = (12, 30, 5, 19, 2)


def naive_logps(model: torch.nn.Module, tokens: list[int], scored: np.ndarray, t: float = 1.0):
    """float64 reference: full logits, log_softmax(logits / T), gathered at the next token."""
    ids = torch.tensor(tokens)[None]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].double()  # [L, V]
    logps = torch.log_softmax(logits / t, dim=-1)  # [L, V]
    pos = torch.from_numpy(scored)
    return logps[pos - 1, ids[0, pos]].numpy()  # [n]


def _seqs(lengths=LENGTHS, seed: int = 0) -> list[SequenceInput]:
    return [
        SequenceInput(random_tokens(n, seed + i), prompt_len=max(1, n // 3))
        for i, n in enumerate(lengths)
    ]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("packing", ["packed", "padded"])
def test_logps_match_naive_float64(arch: str, packing: str) -> None:
    model = tiny_causal(arch)
    ex = StatelessExecutor(ExecutorConfig(packing=packing, logprob_chunk_tokens=7), model)
    seqs = _seqs()
    out = ex.score(seqs)
    assert out.metrics.packed == (packing == "packed")
    assert (out.metrics.padded_tokens == 0) == (packing == "packed")
    assert out.metrics.packed_fill_tokens == 0  # one packed row, or no packing at all
    for s, score in zip(seqs, out.scores, strict=True):
        n = len(s.tokens)
        want = naive_logps(model, s.tokens, np.arange(s.prompt_len, n))
        assert score.logps is not None and score.logps.dtype == np.float32
        assert score.logps.shape == (n - s.prompt_len,)
        assert np.abs(score.logps - want).max() <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_packed_equals_padded_equals_one_by_one(arch: str, backend: str) -> None:
    model = tiny_causal(arch)
    seqs = _seqs(seed=5)
    packed = StatelessExecutor(ExecutorConfig(packing="packed", attention_backend=backend), model)
    assert packed.attention_backend == backend and packed.packed
    padded = StatelessExecutor(ExecutorConfig(packing="padded", attention_backend=backend), model)
    a = packed.score(seqs).scores
    b = padded.score(seqs).scores
    c = [packed.score([s]).scores[0] for s in seqs]
    for x, y, z in zip(a, b, c, strict=True):
        assert np.abs(x.logps - y.logps).max() <= 1e-5
        assert np.abs(x.logps - z.logps).max() <= 1e-5


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_side_invariance(side: str) -> None:
    """A naive padded HF forward (left or right, positions from the mask) gives our numbers."""
    model = tiny_causal("qwen2")
    seqs = _seqs(seed=9)
    ours = StatelessExecutor(ExecutorConfig(), model).score(seqs).scores
    width = max(len(s.tokens) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        n = len(s.tokens)
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        ids[i, cols] = torch.tensor(s.tokens)
        mask[i, cols] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.double()
    logps = torch.log_softmax(logits, -1)
    for i, (s, score) in enumerate(zip(seqs, ours, strict=True)):
        n = len(s.tokens)
        off = width - n if side == "left" else 0
        t = torch.arange(s.prompt_len, n)
        want = logps[i, off + t - 1, ids[i, off + t]].numpy()
        assert np.abs(score.logps - want).max() <= 1e-4


@pytest.mark.parametrize("temperature", [0.5, 1.7])
def test_temperature(temperature: float) -> None:
    model = tiny_causal("mistral")
    seqs = _seqs(seed=3)
    by_config = StatelessExecutor(ExecutorConfig(temperature=temperature), model).score(seqs)
    per_call = StatelessExecutor(ExecutorConfig(), model).score(seqs, temperature=temperature)
    plain = StatelessExecutor(ExecutorConfig(), model).score(seqs)
    for s, a, b, c in zip(seqs, by_config.scores, per_call.scores, plain.scores, strict=True):
        want = naive_logps(model, s.tokens, np.arange(s.prompt_len, len(s.tokens)), temperature)
        assert np.abs(a.logps - want).max() <= 1e-4
        assert np.array_equal(a.logps, b.logps)
        assert not np.allclose(a.logps, c.logps, atol=1e-3)


def test_mask_scores_only_marked_tokens_and_input_types() -> None:
    model = tiny_causal("llama")
    ex = StatelessExecutor(ExecutorConfig(output_dtype="float64"), model)
    tokens = random_tokens(16, 77)
    mask = [0] * 4 + [1] * 4 + [0] * 3 + [1] * 5  # multi-turn: a tool output is not scored
    variants = [
        SequenceInput(tokens, mask=mask),
        SequenceInput(np.array(tokens, dtype=np.int32), mask=bytes(mask)),
        SequenceInput(torch.tensor(tokens), mask=np.array(mask, dtype=bool)),
        SequenceInput(array.array("q", tokens), mask=mask),
    ]
    out = ex.score(variants)
    want = naive_logps(model, tokens, np.flatnonzero(mask))
    for score in out.scores:
        assert score.logps is not None and score.logps.dtype == np.float64
        assert np.abs(score.logps - want).max() <= 1e-4
    assert out.metrics.scored_tokens == 4 * 9


def test_order_and_budget_split() -> None:
    """A small token budget forces several forwards; the output still follows input order."""
    model = tiny_causal("gpt2")
    seqs = _seqs(lengths=(40, 3, 25, 8, 33, 2, 17), seed=11)
    config = ExecutorConfig(packing="packed")  # the layout these forward counts are for
    small = StatelessExecutor(replace(config, max_batch_tokens=45), model).score(seqs)
    big = StatelessExecutor(config, model).score(seqs)
    assert small.metrics.forwards > 1 and big.metrics.forwards == 1
    assert small.metrics.real_tokens == sum(len(s.tokens) for s in seqs)
    for s, a, b in zip(seqs, small.scores, big.scores, strict=True):
        assert len(a.logps) == len(s.tokens) - s.prompt_len
        assert np.abs(a.logps - b.logps).max() <= 1e-5


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_several_packed_rows_per_forward(arch: str) -> None:
    """Short packed rows (tails padded as isolated pseudo-sequences) give the same numbers."""
    model = tiny_causal(arch)
    seqs = _seqs(lengths=(40, 3, 25, 8, 33, 2, 17), seed=13)
    config = ExecutorConfig(packing="packed")  # auto runs unmasked buckets on sdpa
    rows = StatelessExecutor(replace(config, packed_row_tokens=30), model).score(seqs)
    one_row = StatelessExecutor(config, model).score(seqs)
    assert rows.metrics.forwards == 1 and rows.metrics.packed
    # Row fill is reported apart from padding: padded_tokens counts padded-bucket padding only.
    assert rows.metrics.padded_tokens == 0 and one_row.metrics.padded_tokens == 0
    assert rows.metrics.packed_fill_tokens > 0 and one_row.metrics.packed_fill_tokens == 0
    row_lengths = [40, 25 + 3 + 2, 33, 17 + 8]  # first-fit decreasing into rows of <= 30 tokens
    assert rows.metrics.packed_fill_tokens == sum(max(row_lengths) - n for n in row_lengths)
    for a, b in zip(rows.scores, one_row.scores, strict=True):
        assert np.abs(a.logps - b.logps).max() <= 1e-5
