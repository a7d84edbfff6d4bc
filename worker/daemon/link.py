"""The worker's main Redis connection: (re)connect, consumer groups, backoff while Redis is away.

While Redis is unreachable (or refuses writes for now) readiness is false and the worker retries
with a backoff from 0.1 s doubling to 3 s; the first success logs how many attempts failed.
Every connection or cluster error while connecting or reconnecting (no reachable seed node,
``CLUSTERDOWN`` while a replica is promoted, ``READONLY`` from a demoted primary) is such a
retry, counted in ``scoring_redis_reconnects_total``, never fatal. On a Cluster, each failure
records the topology the live client knows (``connections.remember``) so a fresh client (the
lease keeper's, or this one's) tries the promoted nodes before the seeds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import redis

from worker import connections, streams
from worker.daemon.config import WorkerConfig
from worker.observability.health import HealthState
from worker.observability.metrics import WorkerMetrics

log = logging.getLogger(__name__)
#: Errors that mean Redis is away (the connection or the cluster's topology, not the command,
#: failed): ``ConnectionError``, ``TimeoutError``, and the cluster errors of a failover.
REDIS_DOWN = connections.CONNECT_ERRORS


class RedisLink:
    """Owns the client of the worker's loop (the lease keeper has its own)."""

    def __init__(
        self,
        factory: Callable[[], Any],
        config: WorkerConfig,
        *,
        health: HealthState,
        metrics: WorkerMetrics,
        wait: Callable[[float], None],
    ) -> None:
        self.factory = factory
        self.config = config
        self._health = health
        self._metrics = metrics
        self._wait = wait
        self.client: Any = None
        self.failures = 0

    def connect(self) -> tuple[int, int, int] | None:
        """Connect and create missing groups; the server version, or None after a backoff."""
        try:
            if self.client is None:
                self.client = self.factory()
            version = streams.server_version(self.client)
            self.ensure_groups()
            self.ok()
            return version
        except Exception as exc:  # only what a failover or an outage raises; the rest is a bug
            if not (isinstance(exc, REDIS_DOWN) or streams.is_transient(exc)):
                raise
            self.down(exc)
            return None

    def ensure_groups(self) -> None:
        """Create the consumer group on every job stream that lacks it."""
        for stream in self.config.streams:
            if streams.ensure_group(self.client, stream, self.config.group):
                log.info("created consumer group %s on %s", self.config.group, stream)

    def ok(self) -> None:
        """A command went through: Redis is reachable (again)."""
        if self.failures:
            log.info("redis reachable again after %d failures", self.failures)
        self.failures = 0
        self._health.redis_ok = True

    def down(self, exc: BaseException) -> None:
        """Redis failed us: not ready, count it, back off before the next try."""
        self.failures += 1
        self._health.redis_ok = False
        if self.client is not None:
            connections.remember(self.client)
        self._metrics.redis_reconnects.inc()
        delay = min(0.1 * 2 ** min(self.failures - 1, 5), 3.0)
        log.warning("redis unreachable (%s); retry %d in %.1fs", exc, self.failures, delay)
        self._wait(delay)
        self._health.beat("loop")

    def forget_consumer(self) -> None:
        """On a clean stop, delete this consumer from its groups where it holds nothing, so
        replaced pods do not pile up as dead consumers (``XGROUP DELCONSUMER``)."""
        cfg = self.config
        if not cfg.forget_consumer or self.client is None:
            return
        for stream in cfg.streams:
            try:
                if streams.forget_consumer(self.client, stream, cfg.group, cfg.consumer):
                    log.info("left group %s on %s", cfg.group, stream)
            except redis.RedisError as exc:
                log.warning("could not leave group %s on %s: %s", cfg.group, stream, exc)
