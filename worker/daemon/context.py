"""What the daemon's roles share: the jobs it holds, what a step produces, and the job context.

``Pending`` is a decoded job waiting for (or in) a batch; ``Reply`` and ``DeadLetter`` are the two
ways a job leaves the worker, collected in an ``Outbox`` and written together. ``JobContext`` is
everything the job-outcome code (``worker.daemon.intake``, ``worker.daemon.jobs``,
``worker.daemon.writer``) needs, passed in explicitly: the configuration, the scorer, the metrics,
the in-flight set and the dead-letter naming. Nothing here talks to Redis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from worker import streams
from worker.daemon.config import WorkerConfig
from worker.daemon.leases import InFlight
from worker.keys import dead_letter_stream
from worker.observability.metrics import WorkerMetrics
from worker.protocol import Job, Result
from worker.scorer import RESULT_INFO_KEYS, BatchKey, FallbackEvent, Prepared, Scorer


@dataclass
class Pending:
    """A decoded job held by this worker, waiting for (or in) a batch."""

    entry: streams.Entry
    job: Job
    prepared: Prepared  # the job as its scorer planned it at intake
    read_at_s: float

    @property
    def key(self) -> BatchKey:
        """Jobs sharing ``(mode, temperature, options)`` can share one scorer call."""
        return self.prepared.key

    @property
    def tokens(self) -> int:
        """What the job counts for in a batch's token budget: the tokens its scorer computes
        (``Prepared.cost``: a shared prefix once), else every token of every sequence."""
        cost = self.prepared.cost
        return self.job.num_tokens if cost is None else cost


class Reply(NamedTuple):
    """A result for the producer; writing it acks the entry."""

    entry: streams.Entry
    reply_to: str | None
    result: Result
    read_at_s: float | None


class DeadLetter(NamedTuple):
    """An entry for the dead-letter stream, with the result its producer gets (if reachable)."""

    entry: streams.Entry
    reason: str
    result: Result | None
    reply_to: str | None


@dataclass
class Outbox:
    """Results and dead letters produced by one step, written together."""

    results: list[Reply] = field(default_factory=list)
    dead: list[DeadLetter] = field(default_factory=list)
    finished: int = 0  # jobs answered or dead-lettered so far (kept across write retries)

    def add(self, item: Reply | DeadLetter) -> None:
        """Queue a result or a dead letter."""
        if isinstance(item, Reply):
            self.results.append(item)
        else:
            self.dead.append(item)

    def __bool__(self) -> bool:
        return bool(self.results or self.dead)


@dataclass(frozen=True)
class JobContext:
    """What deciding and writing a job's outcome needs, and nothing of the worker's loop."""

    config: WorkerConfig
    scorer: Scorer
    metrics: WorkerMetrics
    in_flight: InFlight

    def dead_stream_of(self, stream: str) -> str:
        """The dead-letter stream of job stream ``stream``."""
        return self.config.dead_letter_stream or dead_letter_stream(stream)

    def info(self, **extra: Any) -> dict[str, Any]:
        """The ``info`` map of a result: model, dtype, device, worker, plus ``extra``."""
        base = self.scorer.info
        info = {k: base[k] for k in RESULT_INFO_KEYS if base.get(k) is not None}
        info["worker"] = self.config.consumer
        info.update({k: v for k, v in extra.items() if v is not None})
        return info

    def load_fallbacks(self) -> list[FallbackEvent]:
        """Attention-backend fallbacks the scorer took while loading (batch-layout changes
        excluded)."""
        layouts = ("packed", "unmasked")
        return [e for e in self.scorer.load_fallbacks if e.requested not in layouts]
