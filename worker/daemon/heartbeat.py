"""The worker's heartbeat: what it serves and holds, published for ``scoring-worker info``.

Every stats step (``stats_interval_s``) the worker writes, per queue it reads, a small hash that
expires after ``ttl_s`` (a few stats intervals) unless renewed
(:func:`worker.streams.write_heartbeat`): its consumer name and group, the scorer's identity
(model, reward model, dtype, device, attention backend) and ``resident``, what the scorer holds
beyond its served models (``Scorer.resident``: per-job adapters and versions with their bytes
and fingerprints, and the residency budget), its ``weight`` on that queue and every queue it
serves with its weight (``queues``: ``a:3,b:1``). A worker that dies stops renewing and drops out
of ``info`` once its heartbeat expires.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from worker import keys, streams
from worker.scorer import Scorer

#: Scorer ``info`` keys copied into the heartbeat.
INFO_FIELDS: tuple[str, ...] = (
    "model",
    "reward_model",
    "dtype",
    "device",
    "attention_backend",
    "tensor_parallel",
    "tensor_parallel_devices",
)


def heartbeat_ttl_s(stats_interval_s: float) -> float:
    """How long a heartbeat lives: three stats intervals, at least 15 s."""
    return max(3.0 * stats_interval_s, 15.0)


class Heartbeat:
    """Publishes one worker's heartbeat on every queue its job streams belong to."""

    def __init__(
        self,
        job_streams: tuple[str, ...],
        *,
        group: str,
        consumer: str,
        scorer: Scorer,
        ttl_s: float,
        weights: dict[str, int] | None = None,
        eviction_allowed: bool = False,
    ) -> None:
        queues = (keys.queue_of(s) for s in job_streams)
        #: The logical queues (streams outside the ``scoring:{q}:jobs`` layout get none).
        self.queues = tuple(dict.fromkeys(q for q in queues if q is not None))
        self.group = group
        self.consumer = consumer
        self.ttl_s = ttl_s
        #: queue -> weight of a worker serving several queues (``weight`` and ``queues`` in
        #: each queue's heartbeat: ``info`` shows how a worker shares itself)
        self.weights = dict(weights or {})
        self._scorer = scorer
        self.eviction_allowed = eviction_allowed  # serve --allow-redis-eviction: info shows it
        self._host = socket.gethostname()

    def fields(self) -> dict[str, Any]:
        """The heartbeat's fields now."""
        info = self._scorer.info
        out: dict[str, Any] = {k: info.get(k) for k in INFO_FIELDS}
        out.update(group=self.group, host=self._host, pid=os.getpid())
        out["modes"] = list(info.get("modes") or [])
        out["resident"] = self._scorer.resident()
        if self.eviction_allowed:
            out["redis_eviction_allowed"] = True
        return out

    def beat(self, client: Any) -> None:
        """Write the heartbeat to every queue (Redis errors propagate to the caller)."""
        if not self.queues:
            return
        fields = self.fields()
        served = ",".join(f"{q}:{w}" for q, w in self.weights.items())
        for queue in self.queues:
            if queue in self.weights:
                fields.update(weight=self.weights[queue], queues=served)
            streams.write_heartbeat(client, queue, self.consumer, fields, self.ttl_s)
