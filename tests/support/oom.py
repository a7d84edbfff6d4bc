"""A simulated device memory that runs out deep inside a model's forward (tests of the OOM split).

``SimulatedCap`` is patched over ``LlamaMLP.forward``: it counts the slots (rows x tokens) a
forward asks for *plus* what earlier failed attempts still hold alive, so a recovery that keeps
the failed forward's frames alive (by running inside the ``except``) runs out again where a
correct one fits. It records, at the start of every attempt, how many tensors of the failed
attempts are still alive (weak references) and, optionally, a figure of the device
(``probe``: ``torch.cuda.memory_allocated`` on a GPU).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.models.llama.modeling_llama import LlamaMLP


@dataclass
class Failed:
    """One attempt that ran out of memory: its size and weak references to its tensors."""

    rows: int
    slots: int  # rows x tokens
    refs: list[weakref.ref[torch.Tensor]]

    def alive(self) -> int:
        """How many of its tensors are still alive."""
        return sum(r() is not None for r in self.refs)


@dataclass
class SimulatedCap:
    """A device that holds ``cap_slots`` (rows x tokens) of activations.

    The first layer's MLP marks the start of an attempt (recording how many tensors of earlier
    failed attempts are still alive then, and ``probe()``); the last layer's MLP asks for
    ``rows * tokens`` slots plus every slot that earlier failed attempts still hold, and raises
    ``torch.OutOfMemoryError`` above the cap, after taking weak references to every tensor in
    the frames of the forward it fails (up to the executor's ``_run_batch``).
    """

    model: Any
    cap_slots: int
    probe: Callable[[], int] | None = None
    original: Any = LlamaMLP.forward
    attempts: list[int] = field(default_factory=list)  # rows of each attempt, in order
    alive_at_start: list[int] = field(default_factory=list)  # failed tensors alive then
    probed_at_start: list[int] = field(default_factory=list)
    failed: list[Failed] = field(default_factory=list)

    def held_slots(self) -> int:
        """Slots that failed attempts still hold."""
        return sum(f.slots for f in self.failed if f.alive())

    def forward(self, mlp: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
        """``LlamaMLP.forward`` under the cap."""
        layers = self.model.model.layers
        if mlp is layers[0].mlp:
            self.attempts.append(int(x.shape[0]))
            self.alive_at_start.append(sum(f.alive() for f in self.failed))
            if self.probe is not None:
                self.probed_at_start.append(self.probe())
        if mlp is layers[-1].mlp:
            slots = int(x.shape[0] * x.shape[1])  # [B, T, H]
            if slots + self.held_slots() > self.cap_slots:
                refs = frame_tensors(self.model)
                self.failed.append(Failed(int(x.shape[0]), slots, refs))
                raise torch.OutOfMemoryError(f"simulated: {slots} slots over {self.cap_slots}")
        return self.original(mlp, x)  # type: ignore[no-any-return]

    def install(self, monkeypatch: Any) -> None:
        """Patch ``LlamaMLP.forward`` (undone by ``monkeypatch``)."""
        monkeypatch.setattr(LlamaMLP, "forward", lambda mlp, x: self.forward(mlp, x))


def frame_tensors(model: Any) -> list[weakref.ref[torch.Tensor]]:
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
        frame = frame.f_back  # type: ignore[assignment]
    assert frame is not None, "the executor's _run_batch frame was not found"
    del frame  # no reference from this frame to the ones the traceback keeps
    return refs
