"""What the daemon drives: the ``Scorer`` protocol, its torch-free inputs and outputs.

The executor (``worker.executor.StatelessExecutor``, torch) and the no-op scorer
(``worker.scorer.noop.NoopScorer``) implement ``Scorer``; the daemon only ever sees this
protocol, so it never imports torch. Nothing here imports torch or redis.

A request is planned once: the daemon's intake calls ``prepare(ScoreRequest)`` and keeps the
``Prepared`` it returns; the batch it later builds of prepared requests with one key runs with
``run`` as planned. Direct callers use ``score`` / ``validate`` (``DirectScoring``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from worker.modes import Mode
from worker.request import DEFAULT_OPTIONS, ScoreOptions, ScoreRequest, SequenceInput
from worker.scorer.outputs import (
    BatchMetrics,
    FallbackEvent,
    GroupReport,
    ScoreOutput,
    SequenceScore,
)
from worker.scorer.plan import BatchKey, DirectScoring, Prepared

__all__ = [
    "DEFAULT_OPTIONS",
    "INFO_KEYS",
    "OPTIONAL_INFO_KEYS",
    "RESULT_INFO_KEYS",
    "BatchKey",
    "BatchMetrics",
    "DirectScoring",
    "FallbackEvent",
    "GroupReport",
    "Prepared",
    "ScoreOptions",
    "ScoreOutput",
    "ScoreRequest",
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
#: objectives' names, a tensor-parallel group's size, a vision-language model's image
#: processor, backend, options and layout); copied into results when present.
OPTIONAL_INFO_KEYS: tuple[str, ...] = (
    "reward_head",
    "reward_objectives",
    "tensor_parallel",
    "vision",
)
#: Keys of ``info`` the daemon copies into every result's ``info`` (when set).
RESULT_INFO_KEYS: tuple[str, ...] = (
    "model",
    "reward_model",
    "dtype",
    "device",
    *OPTIONAL_INFO_KEYS,
)


@runtime_checkable
class Scorer(Protocol):
    """A scorer the daemon can drive: prepare at intake, run a batch, describe itself."""

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

    def prepare(self, request: ScoreRequest) -> Prepared:
        """Validate ``request`` and plan it, once, at intake (rendering ``messages`` with the
        reward model's chat template, checking every sequence, deciding the calls it runs).

        Raises ``BadRequest`` / ``TooLong`` / ``UnsupportedMode`` / ``ModelNotFound`` when it
        cannot be scored; what it returns is what ``run`` runs.
        """
        ...

    def run(self, batch: Sequence[Prepared]) -> ScoreOutput:
        """Run prepared requests of one ``Prepared.key`` together, as they were planned: the
        scores of their sequences in order (the first request's, then the next one's...), and
        what the call cost."""
        ...
