"""What the worker's Redis keeps, as metrics (``worker.connections.ServerWatch`` reads it at
start and every ``redis_check_interval_s``): a part of ``WorkerMetrics`` (the same registry).

* ``scoring_redis_evicting``: 1 while a primary's ``maxmemory-policy`` is not ``noeviction``
  (served under ``--allow-redis-eviction``, or changed while serving): jobs may be deleted;
* ``scoring_redis_eviction_allowed``: 1 when the process runs with ``--allow-redis-eviction``;
* ``scoring_redis_persistent``: 0 while a primary has neither AOF nor RDB (a restart empties
  the queues), 1 otherwise (or when it cannot be told);
* ``scoring_redis_memory_used_ratio{primary, limit}``: ``used_memory / maxmemory`` of each
  primary (``limit="maxmemory"``), or over the host's memory where no ``maxmemory`` is set
  (``limit="system"``); ``primary`` is ``host:port``: as many values as the cluster has shards.

The gateway exports the same names from ``worker.gateway.metrics`` (a test keeps them equal).
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Gauge

#: The names above, for the test that keeps the gateway's equal.
REDIS_METRIC_NAMES = (
    "scoring_redis_evicting",
    "scoring_redis_eviction_allowed",
    "scoring_redis_persistent",
    "scoring_redis_memory_used_ratio",
)


class RedisServerMetrics:
    """The ``scoring_redis_*`` server metrics (a base of ``WorkerMetrics``)."""

    def build_redis_metrics(self, r: CollectorRegistry) -> None:
        """Create the metrics in registry ``r``."""
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
