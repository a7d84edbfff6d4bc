"""Device OOM: split the batch in halves and retry; a lone sequence that still OOMs -> TooLong.

The second test raises the OOM deep inside the model (the last layer's MLP) under a simulated
memory cap that also counts what earlier failed attempts still hold alive, so it fails when the
recovery runs inside the ``except`` block (whose traceback keeps every frame of the failed
forward, and so its tensors, alive while the halves run).
"""

from __future__ import annotations

import math
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaMLP

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


# ----------------------------------------------------------------------------- freeing the failed


@dataclass
class _Failed:
    """One attempt that ran out of memory: its size and weak references to its tensors."""

    rows: int
    slots: int  # rows x tokens
    refs: list[weakref.ref[torch.Tensor]]

    def alive(self) -> int:
        return sum(r() is not None for r in self.refs)


@dataclass
class SimulatedCap:
    """A device that holds ``cap_slots`` (rows x tokens) of activations.

    Patched over ``LlamaMLP.forward``: the first layer's MLP marks the start of an attempt (and
    records how many tensors of earlier failed attempts are still alive then); the last layer's
    MLP asks for ``rows * tokens`` slots plus every slot that earlier failed attempts still hold
    (their hidden states alive), and raises ``torch.OutOfMemoryError`` above the cap, after taking
    weak references to every tensor in the frames of the forward it fails (up to ``_run_batch``).
    """

    model: Any
    cap_slots: int
    original: Any = LlamaMLP.forward
    attempts: list[int] = field(default_factory=list)  # rows of each attempt, in order
    alive_at_start: list[int] = field(default_factory=list)  # failed tensors alive then
    failed: list[_Failed] = field(default_factory=list)

    def held_slots(self) -> int:
        return sum(f.slots for f in self.failed if f.alive())

    def forward(self, mlp: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
        layers = self.model.model.layers
        if mlp is layers[0].mlp:
            self.attempts.append(int(x.shape[0]))
            self.alive_at_start.append(sum(f.alive() for f in self.failed))
        if mlp is layers[-1].mlp:
            slots = int(x.shape[0] * x.shape[1])  # [B, T, H]
            if slots + self.held_slots() > self.cap_slots:
                refs = _frame_tensors(self.model)
                self.failed.append(_Failed(int(x.shape[0]), slots, refs))
                raise torch.OutOfMemoryError(f"simulated: {slots} slots over {self.cap_slots}")
        return self.original(mlp, x)  # type: ignore[no-any-return]


def _frame_tensors(model: Any) -> list[weakref.ref[torch.Tensor]]:
    """Weak references to every tensor local of the frames from the caller up to (not
    including) the executor's ``_run_batch``: the failed forward's activations and masks."""
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    refs: list[weakref.ref[torch.Tensor]] = []
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "_run_batch":
        refs += [
            weakref.ref(v)
            for v in frame.f_locals.values()
            if isinstance(v, torch.Tensor) and id(v) not in own
        ]
        frame = frame.f_back
    assert frame is not None, "the executor's _run_batch frame was not found"
    del frame  # no reference from this frame to the ones the traceback keeps
    return refs


def test_a_failed_attempt_is_freed_before_its_halves_run_and_splits_are_minimal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows, tokens, fit_rows = 8, 16, 2
    seqs = [SequenceInput(random_tokens(tokens, i), prompt_len=4) for i in range(rows)]
    model = tiny_causal("llama", seed=0)
    ex = StatelessExecutor(ExecutorConfig(packing="padded"), model)
    clean = ex.score(seqs)
    cap = SimulatedCap(model, cap_slots=fit_rows * tokens)
    monkeypatch.setattr(LlamaMLP, "forward", lambda mlp, x: cap.forward(mlp, x))

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
