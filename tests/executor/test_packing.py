"""Batch layouts: packed rows restart positions per sequence, padded buckets respect the budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.executor.packing import (
    gather_flat,
    pack,
    pad,
    pad_unmasked,
    plan_buckets,
    plan_packed,
    plan_padded,
)
from worker.executor.rewards.pooling import token_index

SEQS = [np.array([5, 6, 7]), np.array([1]), np.array([9, 8, 7, 6])]


def test_pack_layout() -> None:
    b = pack(SEQS, [10, 11, 12])
    assert b.input_ids.tolist() == [[5, 6, 7, 1, 9, 8, 7, 6]]
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert b.attention_mask is None and b.packed
    assert b.starts.tolist() == [0, 3, 4] and b.last_index.tolist() == [2, 3, 7]
    assert b.real_tokens == b.slot_tokens == 8 and b.seq_ids == (10, 11, 12)


@pytest.mark.parametrize("side", ["left", "right"])
def test_pad_layout(side: str) -> None:
    b = pad(SEQS, [0, 1, 2], pad_id=0, side=side)
    assert b.input_ids.shape == (3, 4) and b.slot_tokens == 12 and b.real_tokens == 8
    flat = b.input_ids.reshape(-1)
    for i, seq in enumerate(SEQS):
        s = int(b.starts[i])
        assert flat[s : s + len(seq)].tolist() == seq.tolist()
        assert b.attention_mask is not None
        assert int(b.attention_mask[i].sum()) == len(seq)
        assert b.position_ids.reshape(-1)[s : s + len(seq)].tolist() == list(range(len(seq)))
    with pytest.raises(ValueError):
        pad(SEQS, [0, 1, 2], side="middle")


def test_pad_unmasked_layout() -> None:
    """Right pads, no mask, positions counting through the pads (no restart: no packing)."""
    b = pad_unmasked(SEQS, [0, 1, 2])
    assert b.attention_mask is None and not b.packed
    assert b.input_ids.tolist() == [[5, 6, 7, 0], [1, 0, 0, 0], [9, 8, 7, 6]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3]] * 3
    assert b.starts.tolist() == [0, 4, 8] and b.last_index.tolist() == [2, 4, 11]
    assert b.slot_tokens == 12 and b.real_tokens == 8


def test_plan_buckets_bounds_padding_and_budget() -> None:
    rng = np.random.default_rng(1)
    lengths = [*rng.integers(1, 300, size=100).tolist(), 700, 120, 120, 120]
    for fraction in (0.0, 0.1, 0.5):
        groups = plan_buckets(lengths, 1024, fraction)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            slots = len(g) * max(lengths[i] for i in g)
            assert slots <= 1024 or len(g) == 1
            assert slots - sum(lengths[i] for i in g) <= fraction * slots
    # Naive equivalent at fraction 0: every sequence alone, except equal lengths.
    assert sorted(map(sorted, plan_buckets([5, 9, 3, 9], 100, 0.0))) == [[0], [1, 3], [2]]
    # fraction 1: padding is free, only the budget bounds a bucket (plan_padded).
    assert plan_buckets(lengths, 1024, 1.0) == plan_padded(lengths, 1024)


def test_token_index_and_gather() -> None:
    b = pad(SEQS, [0, 1, 2], side="left")
    hidden = b.input_ids[..., None].float()  # [R, T, 1]
    got = gather_flat(hidden, token_index(b))[:, 0].long().tolist()
    assert got == [5, 6, 7, 1, 9, 8, 7, 6]


@pytest.mark.parametrize("planner", [plan_packed, plan_padded])
def test_plans_cover_every_sequence_within_budget(planner) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    lengths = [*rng.integers(1, 300, size=100).tolist(), 700]
    groups = planner(lengths, 512)
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(len(lengths)))
    for g in groups:
        cost = (
            sum(lengths[i] for i in g)
            if planner is plan_packed
            else len(g) * max(lengths[i] for i in g)
        )
        assert cost <= 512 or len(g) == 1  # an over-budget sequence runs alone


def test_packed_ids_are_int64_tensors() -> None:
    b = pack([np.array([1, 2], dtype=np.int32)], [0])
    assert b.input_ids.dtype == torch.int64 and b.position_ids.dtype == torch.int64


def test_pack_rows_isolates_tails_and_maps_starts() -> None:
    from worker.executor.packing import pack_rows, plan_packed_forwards

    rows = [[SEQS[0], SEQS[1]], [SEQS[2]], [np.array([4, 4])]]
    b = pack_rows(rows, [0, 1, 2, 3])
    assert b.input_ids.shape == (3, 4) and b.packed and b.attention_mask is None
    assert b.position_ids.tolist() == [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 0, 1]]
    flat = b.input_ids.reshape(-1)
    for start, seq in zip(b.starts.tolist(), [SEQS[0], SEQS[1], SEQS[2], [4, 4]], strict=True):
        assert flat[start : start + len(seq)].tolist() == list(seq)
    lengths = [300, 200, 900, 50, 120, 1500]
    forwards = plan_packed_forwards(lengths, 4096, 1024)
    assert sorted(i for f in forwards for r in f for i in r) == list(range(6))
    for f in forwards:
        widths = [sum(lengths[i] for i in r) for r in f]
        assert all(w <= 1024 or len(r) == 1 for w, r in zip(widths, f, strict=True))
        assert len(f) * max(widths) <= 4096


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("impl", ["sdpa", "eager", "flex_attention"])
def test_packed_rows_match_per_sequence_logits_in_transformers(impl: str) -> None:
    """The packed layout (one row, position_ids restarting per sequence) isolates sequences in
    transformers' sdpa, eager and flex_attention paths (flex compiles on CPU: tens of seconds)."""
    from tests.support.models import random_tokens, tiny_causal

    model = tiny_causal("llama")
    model.set_attn_implementation(impl)
    seqs = [np.asarray(random_tokens(n, i)) for i, n in enumerate((12, 30, 5, 19, 2))]
    batch = pack(seqs, list(range(len(seqs))))
    with torch.no_grad():
        packed = model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False
        ).logits[0]  # [T, V]
        for start, s in zip(batch.starts.tolist(), seqs, strict=True):
            alone = model(input_ids=torch.as_tensor(s)[None], use_cache=False).logits[0]
            assert (packed[start : start + len(s)] - alone).abs().max().item() < 1e-4
