"""A request as its scorer planned it: ``Prepared``, and the direct API built on the contract.

``Scorer.prepare`` validates a ``ScoreRequest`` and plans it once, at intake; ``Scorer.run``
runs what was planned (several prepared requests of one batch key together), never planning
again. ``DirectScoring`` gives every scorer the one-call API that tests, benchmarks and the
GPU check use: ``score(seqs, mode=..., ...)`` is ``run([prepare(ScoreRequest(...))])``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from worker.modes import Mode
from worker.request import DEFAULT_OPTIONS, ScoreOptions, ScoreRequest, SequenceInput
from worker.scorer.outputs import ScoreOutput

__all__ = ["BatchKey", "DirectScoring", "Prepared"]

#: What jobs share to be scored in one call: mode, temperature and options.
BatchKey = tuple[Mode, float, ScoreOptions]


@dataclass(frozen=True)
class Prepared:
    """A request validated and planned by its scorer (see the module docstring).

    ``request``: the request with its sequences as prepared (``messages`` rendered and ``text``
    tokenized into ``rm_ids``); ``mode`` and ``temperature``: resolved (the scorer's defaults
    where the request left them out); ``plan``: the scorer's own plan of the work (the
    executor's: the calls it runs and their checked sequences), read only by that scorer.
    ``cost``: the tokens its forwards compute when that is fewer than all of its sequences'
    tokens (prefix sharing: a shared prefix once), what a batcher counts it for; ``None``: every
    token.
    """

    request: ScoreRequest
    mode: Mode
    temperature: float
    plan: Any = None
    cost: int | None = None

    @property
    def options(self) -> ScoreOptions:
        """The request's options."""
        return self.request.options

    @property
    def inputs(self) -> Sequence[SequenceInput]:
        """The request's sequences as prepared."""
        return self.request.seqs

    @property
    def key(self) -> BatchKey:
        """Requests with equal keys may run in one ``Scorer.run``."""
        return self.mode, self.temperature, self.request.options

    def __len__(self) -> int:
        return len(self.request.seqs)


class _Contract(Protocol):
    def prepare(self, request: ScoreRequest) -> Prepared: ...

    def run(self, batch: Sequence[Prepared]) -> ScoreOutput: ...


class DirectScoring:
    """``validate`` and ``score`` for a direct caller, over ``prepare`` and ``run``."""

    def validate(
        self: _Contract,
        seqs: Sequence[SequenceInput],
        mode: Mode | None = None,
        temperature: float | None = None,
        options: ScoreOptions = DEFAULT_OPTIONS,
    ) -> None:
        """Raise ``BadRequest`` / ``TooLong`` / ``UnsupportedMode`` if ``seqs`` cannot be scored."""
        self.prepare(ScoreRequest(seqs, mode, temperature, options))

    def score(
        self: _Contract,
        seqs: Sequence[SequenceInput],
        *,
        mode: Mode | None = None,
        temperature: float | None = None,
        options: ScoreOptions = DEFAULT_OPTIONS,
    ) -> ScoreOutput:
        """Prepare and run one request: scores of ``seqs`` in input order, and what it cost."""
        return self.run([self.prepare(ScoreRequest(seqs, mode, temperature, options))])
