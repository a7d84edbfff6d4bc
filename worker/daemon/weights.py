"""Per-job weights on the daemon side: a batch's ``WeightsReport`` into metrics and result info.

The scorer reports which adapter/version ran, whether it was resident, the loads and evictions
since its last report, and what it holds now (``worker.scorer.weights``); the daemon records them
here and puts the provenance (``adapter``, ``version``, ``weights_fingerprint``) in each result's
``info``. What a worker holds now is in the ``scoring_weights_resident*`` gauges.
"""

from __future__ import annotations

from typing import Any

from worker.observability.metrics import WorkerMetrics
from worker.scorer.weights import WeightsReport


def record_weights(metrics: WorkerMetrics, report: WeightsReport | None, jobs: int) -> None:
    """Count the report's loads, evictions, the ``jobs`` of the batch as hits or misses, and
    set the residency gauges."""
    if report is None:
        return
    for event in report.loads:
        metrics.weights_loads.labels(
            kind=event.kind, reason=event.reason, outcome=event.outcome
        ).inc()
        metrics.weights_load_seconds.labels(kind=event.kind).observe(event.seconds)
    if report.evictions:
        metrics.weights_evictions.inc(report.evictions)
    if report.hit is not None:
        metrics.weights_jobs.labels(result="hit" if report.hit else "miss").inc(jobs)
    held = report.holdings
    metrics.weights_resident.labels(kind="adapter").set(len(held.adapters))
    metrics.weights_resident.labels(kind="version").set(len(held.versions))
    metrics.weights_resident_bytes.set(held.bytes)


def weights_info(report: WeightsReport | None) -> dict[str, Any]:
    """The provenance keys of a result's ``info`` (empty for the base weights)."""
    return dict(report.provenance()) if report is not None else {}
