"""The per-queue metrics of a worker that serves several weighted queues (``serve --queue a:3
--queue b:1``, docs/scaling.md): jobs finished, what each queue got of the batches, what waits
for a batch, lag and weight, each labelled by ``queue``. A part of ``WorkerMetrics`` (built
from the same registry); the fleet-wide names (``scoring_jobs_total``, ...) stay as they are.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge


class QueueMetrics:
    """The ``scoring_queue_*`` metrics (a base of ``WorkerMetrics``)."""

    def build_queue_metrics(self, r: CollectorRegistry) -> None:
        """Create the per-queue metrics in registry ``r``."""
        self.queue_jobs = Counter(
            "scoring_queue_jobs_total",
            "Jobs finished, by queue and outcome.",
            ["queue", "outcome"],
            registry=r,
        )
        self.queue_batch_jobs = Counter(
            "scoring_queue_batch_jobs_total",
            "Jobs handed to batches, by queue.",
            ["queue"],
            registry=r,
        )
        self.queue_batch_tokens = Counter(
            "scoring_queue_batch_tokens_total",
            "Tokens handed to batches, by queue (the share of the worker each queue got).",
            ["queue"],
            registry=r,
        )
        self.queue_backlog_jobs = Gauge(
            "scoring_queue_backlog_jobs",
            "Jobs read and waiting for a batch, by queue.",
            ["queue"],
            registry=r,
        )
        self.queue_backlog_tokens = Gauge(
            "scoring_queue_backlog_tokens",
            "Tokens read and waiting for a batch, by queue.",
            ["queue"],
            registry=r,
        )
        self.queue_lag = Gauge(
            "scoring_queue_lag",
            "Entries not yet delivered to the group, summed over the queue's partitions.",
            ["queue", "group"],
            registry=r,
        )
        self.queue_weight = Gauge(
            "scoring_queue_weight",
            "The weight this worker gives each queue it serves.",
            ["queue"],
            registry=r,
        )

    def set_queue_weights(self, weights: Mapping[str, int]) -> None:
        """Export each served queue's weight (and its per-queue series at 0)."""
        for queue, weight in weights.items():
            self.queue_weight.labels(queue=queue).set(weight)
            self.queue_batch_jobs.labels(queue=queue)
            self.queue_batch_tokens.labels(queue=queue)
            self.queue_jobs.labels(queue=queue, outcome="ok")

    def set_queue_backlog(self, held: Mapping[str, tuple[int, int]]) -> None:
        """``{queue: (jobs, tokens)}`` waiting for a batch now."""
        for queue, (jobs, tokens) in held.items():
            self.queue_backlog_jobs.labels(queue=queue).set(jobs)
            self.queue_backlog_tokens.labels(queue=queue).set(tokens)

    def record_queue_batch(self, share: Mapping[str, tuple[int, int]]) -> None:
        """Count what one batch took from each queue: ``{queue: (jobs, tokens)}``."""
        for queue, (jobs, tokens) in share.items():
            self.queue_batch_jobs.labels(queue=queue).inc(jobs)
            self.queue_batch_tokens.labels(queue=queue).inc(tokens)
