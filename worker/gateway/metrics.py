"""The gateway's Prometheus metrics, built inside one object over an injectable registry.

* ``scoring_gateway_requests_total{route, status}``: requests answered, by HTTP status;
* ``scoring_gateway_request_seconds{route}``: time from the request to its answer;
* ``scoring_gateway_in_flight``: requests being answered now;
* ``scoring_gateway_errors_total{route, code}``: error answers by error code;
* ``scoring_gateway_jobs_total``: jobs submitted (requests are coalesced into them);
* ``scoring_gateway_sequences_total{route}``: sequences sent for scoring;
* ``scoring_gateway_unauthorized_total{reason}``: 401s, by ``missing`` or ``wrong`` key;
* what Redis keeps, as the worker exports it (``worker.observability.redis_metrics``; a test
  keeps the two equal): ``scoring_redis_evicting``, ``scoring_redis_eviction_allowed``,
  ``scoring_redis_persistent``, ``scoring_redis_memory_used_ratio{primary, limit}``.

``route`` is the route's path (a few fixed values; ``other`` for anything else).
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Buckets from a millisecond to ten minutes (one-sample requests to long batches).
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)


class GatewayMetrics:
    """Every gateway metric, registered on ``registry`` (a fresh one in tests)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "scoring_gateway_requests_total", "Requests answered.", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "scoring_gateway_request_seconds",
            "Request to answer.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("scoring_gateway_in_flight", "Requests being answered.", registry=r)
        self.errors = Counter(
            "scoring_gateway_errors_total",
            "Error answers by error code.",
            ["route", "code"],
            registry=r,
        )
        self.jobs = Counter("scoring_gateway_jobs_total", "Jobs submitted.", registry=r)
        self.sequences = Counter(
            "scoring_gateway_sequences_total", "Sequences sent to score.", ["route"], registry=r
        )
        self.unauthorized = Counter(
            "scoring_gateway_unauthorized_total",
            "Requests refused for a missing or wrong key.",
            ["reason"],
            registry=r,
        )
        self.redis_evicting = Gauge(
            "scoring_redis_evicting",
            "1 while a Redis primary's maxmemory-policy is not noeviction (jobs may be deleted).",
            registry=r,
        )
        self.redis_eviction_allowed = Gauge(
            "scoring_redis_eviction_allowed",
            "1 when this process runs with --allow-redis-eviction.",
            registry=r,
        )
        self.redis_persistent = Gauge(
            "scoring_redis_persistent",
            "0 while a Redis primary has neither AOF nor RDB (a restart empties the queues).",
            registry=r,
        )
        self.redis_memory_used_ratio = Gauge(
            "scoring_redis_memory_used_ratio",
            "used_memory / maxmemory of each Redis primary (limit=system: over the host's memory, "
            "no maxmemory set).",
            ["primary", "limit"],
            registry=r,
        )

    def set_redis_server(
        self,
        *,
        evicting: bool,
        allowed: bool,
        persistent: bool,
        memory_used_ratio: Mapping[tuple[str, str], float],
    ) -> None:
        """Export one read of the server (``memory_used_ratio``: (primary, limit) -> ratio)."""
        self.redis_evicting.set(int(evicting))
        self.redis_eviction_allowed.set(int(allowed))
        self.redis_persistent.set(int(persistent))
        for (primary, limit), ratio in memory_used_ratio.items():
            self.redis_memory_used_ratio.labels(primary=primary, limit=limit).set(ratio)
