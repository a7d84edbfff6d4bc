"""What the daemon drives: the ``Scorer`` protocol, its torch-free inputs and outputs.

The executor (``worker.executor.StatelessExecutor``, torch) and the no-op scorer
(``worker.scorer.noop.NoopScorer``) implement ``Scorer``; the daemon only ever sees this
protocol, so it never imports torch. Nothing here imports torch or redis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from worker.modes import Mode
from worker.scorer.inputs import SequenceInput
from worker.scorer.options import DEFAULT_OPTIONS, ScoreOptions
from worker.scorer.outputs import (
    BatchMetrics,
    FallbackEvent,
    GroupReport,
    ScoreOutput,
    SequenceScore,
)

__all__ = [
    "DEFAULT_OPTIONS",
    "INFO_KEYS",
    "OPTIONAL_INFO_KEYS",
    "BatchMetrics",
    "FallbackEvent",
    "GroupReport",
    "ScoreOptions",
    "ScoreOutput",
    "Scorer",
    "SequenceInput",
    "SequenceScore",
]

#: Keys every scorer's ``info`` carries (a value may be ``None``): what results, logs and the
#: build-info metric read from it. A scorer may add more.
INFO_KEYS: tuple[str, ...] = (
    "model",
    "reward_model",
    "dtype",
    "device",
    "attention_backend",
    "requested_backend",
)
#: Keys a scorer's ``info`` carries only when they apply (a reward model's head kind and its
#: objectives' names, a tensor-parallel group's size); copied into results when present.
OPTIONAL_INFO_KEYS: tuple[str, ...] = ("reward_head", "reward_objectives", "tensor_parallel")


@runtime_checkable
class Scorer(Protocol):
    """A scorer the daemon can drive: validate at intake, score a batch, describe itself."""

    @property
    def modes(self) -> tuple[Mode, ...]:
        """The modes this scorer serves (a subset of ``worker.modes.MODES``)."""
        ...

    @property
    def info(self) -> dict[str, Any]:
        """Identity of what produces the scores: at least ``INFO_KEYS`` (model, dtype, device,
        backend, ...); goes into every result's ``info`` and the build-info metric."""
        ...

    @property
    def load_fallbacks(self) -> list[FallbackEvent]:
        """Fallbacks taken while loading (attention backend, packing), oldest first."""
        ...

    def add_fallback_listener(self, callback: Callable[[FallbackEvent], None]) -> None:
        """Call ``callback(event)`` on every run-time fallback."""
        ...

    def resident(self) -> dict[str, Any]:
        """What the scorer holds beyond its served models (per-job adapters/versions), as plain
        JSON-ready data for the worker's heartbeat; ``{}`` when it serves none."""
        ...

    def validate(
        self,
        seqs: Sequence[SequenceInput],
        mode: Mode | None = None,
        temperature: float | None = None,
        options: ScoreOptions = DEFAULT_OPTIONS,
    ) -> None:
        """Raise ``BadRequest`` / ``TooLong`` / ``UnsupportedMode`` if ``seqs`` cannot be scored."""
        ...

    def prepare(
        self,
        seqs: Sequence[SequenceInput],
        mode: Mode | None = None,
        temperature: float | None = None,
        options: ScoreOptions = DEFAULT_OPTIONS,
    ) -> list[SequenceInput]:
        """``validate``, then do the per-sequence work that needs no device (rendering
        ``messages`` with the reward model's chat template) and return the inputs to ``score``.

        Called at intake, before batching, so tokenisation stays off the forward's critical
        path; a scorer with nothing to prepare returns ``list(seqs)``.
        """
        ...

    def score(
        self,
        seqs: Sequence[SequenceInput],
        *,
        mode: Mode | None = None,
        temperature: float | None = None,
        options: ScoreOptions = DEFAULT_OPTIONS,
    ) -> ScoreOutput:
        """Score ``seqs`` (in input order) and report what the call cost."""
        ...
