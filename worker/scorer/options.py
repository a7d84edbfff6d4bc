"""Per-job scoring options beyond mode and temperature, torch-free.

One frozen, hashable ``ScoreOptions`` travels from the decoded job (``worker.daemon.intake``)
through the daemon's batching (jobs with equal options share one scorer call) to the scorer's
``validate``/``score``. Each capability that adds a job option adds a field here (with a
default that means "as before"), its validation in ``check``, and its mapping from the wire in
the daemon's intake. ``ScoreOptions()`` is today's behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.scorer.steps import StepOptions
from worker.scorer.teacher import LOGPS_ONLY, TokenOutputs

__all__ = ["DEFAULT_OPTIONS", "ScoreOptions"]


@dataclass(frozen=True)
class ScoreOptions:
    """Options of one scorer call; the defaults reproduce a plain log-prob / reward job."""

    # Per-job weights (docs/models.md): a LoRA adapter directory under the worker's
    # --adapter-root and/or a full checkpoint under --model-root; None = the served base.
    adapter: str | None = None
    version: str | None = None

    # teacher outputs (distillation): the per-position arrays a job wants beyond logps
    outputs: TokenOutputs = LOGPS_ONLY

    # process rewards: the job's ``step`` map (None: a plain sequence reward)
    step: StepOptions | None = None

    def describe(self) -> dict[str, object]:
        """The options that differ from the defaults (for logs and result ``info``)."""
        out: dict[str, object] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if value != getattr(DEFAULT_OPTIONS, name):
                out[name] = value
        return out


DEFAULT_OPTIONS = ScoreOptions()
