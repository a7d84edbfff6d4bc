"""What the worker's Redis keeps: its eviction policy, persistence and memory, read when the
worker connects and every ``redis_check_interval_s`` after (``worker.connections.ServerWatch``),
published as metrics (``scoring_redis_*``) and in ``/readyz``'s details.

At the first read a ``maxmemory-policy`` other than ``noeviction`` stops the worker
(``ConfigError``, one line) unless ``allow_redis_eviction``; ``serve`` reads it once already
before the model loads, so a refusal takes a second, not a model load. A policy changed while
serving is logged as an error and turns ``scoring_redis_evicting`` on.
"""

from __future__ import annotations

from typing import Any

from worker import connections
from worker.connections import ServerState, ServerWatch
from worker.daemon.config import WorkerConfig
from worker.observability.health import HealthState
from worker.observability.metrics import WorkerMetrics


class ServerCheck:
    """Reads the server when due and publishes what it read."""

    def __init__(self, config: WorkerConfig, *, metrics: WorkerMetrics, health: HealthState):
        self.allowed = config.allow_redis_eviction
        self.watch = ServerWatch(config.redis_check_interval_s)
        self._metrics = metrics
        self._health = health
        self._checked = False

    def first(self, client: Any) -> None:
        """The check at connect: ``ConfigError`` when a primary evicts and that is not allowed."""
        if not self._checked:
            self.checked(connections.check_server(client, allow_eviction=self.allowed))

    def checked(self, states: list[ServerState]) -> None:
        """Take the start-up check's read (``serve`` made it before the model loaded)."""
        self.publish(states)
        self.watch = ServerWatch(self.watch.interval_s, states)
        self._checked = True

    def maybe(self, client: Any) -> None:
        """Read again when due (a policy change is logged by the watch) and publish."""
        states = self.watch.poll(client)
        if states is not None:
            self.publish(states)

    def publish(self, states: list[ServerState]) -> None:
        """Metrics and health details of one read."""
        self.watch.states = states
        summary = connections.server_summary(states, allowed=self.allowed)
        self._metrics.set_redis_server(
            evicting=summary["evicting"],
            allowed=self.allowed,
            persistent=summary["persistent"],
            memory_used_ratio={
                (s.node, str(s.memory_limit)): ratio
                for s in states
                if (ratio := s.memory_used_ratio) is not None
            },
        )
        self._health.redis_server = summary
