"""The worker daemon's configuration: how it consumes its streams (built by ``serve`` from
flags and ``SCORING_*`` env, then passed down). Units are in field names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from worker.errors import ConfigError
from worker.keys import DEFAULT_GROUP, job_streams
from worker.keys import queue_of as stream_queue
from worker.protocol import Limits
from worker.scorer.teacher import MAX_TOPK
from worker.streams.durable import Durability


@dataclass(frozen=True)
class QueueShare:
    """One queue of a worker: its name, its job streams and its weight (the worker's batches
    are shared among its backlogged queues in proportion to the weights, by tokens)."""

    name: str
    streams: tuple[str, ...]
    weight: int = 1

    def __post_init__(self) -> None:
        if not self.streams:
            raise ConfigError(f"queue {self.name!r} has no stream")
        if isinstance(self.weight, bool) or not isinstance(self.weight, int) or self.weight < 1:
            raise ConfigError(
                f"queue {self.name!r}: weight must be a positive integer, got {self.weight!r}"
            )


def queue_shares(specs: Sequence[tuple[str, int]], partitions: int = 1) -> tuple[QueueShare, ...]:
    """The ``QueueShare`` of each ``(queue, weight)``, its streams from ``partitions``
    (``ConfigError`` for a bad name or weight, or a queue named twice)."""
    names = [name for name, _ in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(
            f"queue {twice[0]!r} is named more than once",
            hint="give each queue once: --queue NAME[:WEIGHT]",
        )
    return tuple(QueueShare(n, tuple(job_streams(n, partitions)), w) for n, w in specs)


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker daemon consumes its streams (built by ``serve`` from flags/env).

    ``streams`` are the job stream keys (one per partition); ``dead_letter_stream`` None means
    each stream's own ``...:dead`` stream (``worker.keys.dead_letter_stream``). ``queues``
    groups the streams into weighted queues (``serve --queue a:3 --queue b:1``); empty: one
    queue of weight 1 holds every stream (``shares``).
    """

    streams: tuple[str, ...]
    queues: tuple[QueueShare, ...] = ()
    group: str = DEFAULT_GROUP
    consumer: str = "worker"
    max_batch_tokens: int = 16384
    max_wait_ms: int = 5
    block_ms: int = 1000
    read_count: int = 64
    claim_idle_ms: int = 30000
    reclaim_interval_ms: int | None = None  # default: claim_idle_ms / 2
    max_deliveries: int = 5
    # an entry delivered more often than this runs in a batch of its own (poison isolation)
    isolate_after_deliveries: int = 2
    # delete this consumer from its groups on a clean stop when it holds nothing
    forget_consumer: bool = True
    dead_letter_stream: str | None = None
    drain_timeout_s: float = 60.0
    # on drain, hand the jobs read but not started back to the group (another worker takes them
    # at once) and watch for other workers' hand-backs; False: drain the whole backlog (before)
    handback: bool = True
    batch_timeout_s: float = 1800.0  # /healthz fails once one batch computes longer than this
    result_maxlen: int = 10000
    reply_ttl_s: int = 3600  # a reply stream without a TTL gets this one (0: none)
    dead_letter_maxlen: int = 100000
    # durable result writes: WAIT for this many replicas after a result write on another node
    # than its job, ack only then (0: off); durable_all_results WAITs after the one-script
    # write + ack too (docs/guarantees.md)
    durable_replicas: int = 0
    durable_timeout_ms: int = 1000
    durable_all_results: bool = False
    stats_interval_s: float = 5.0
    burst: bool = False
    max_jobs: int | None = None
    # pipelined daemon: the forward runs on a compute thread while the main thread reads the next
    # batch and writes the previous one (False: read, score, write in turn; --no-pipeline)
    pipeline: bool = True
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 9400  # None: no HTTP endpoint; 0: a free port
    limits: Limits = field(default_factory=Limits)
    # teacher outputs: a job whose result would be larger, or whose top-k is larger, gets
    # bad_request at intake (docs/protocol.md, "Teacher outputs")
    max_result_bytes: int = 64 * 1024 * 1024
    max_topk: int = 256
    # a maxmemory-policy other than noeviction is refused at start unless allowed
    # (--allow-redis-eviction); the policy, persistence and memory are read again this often
    allow_redis_eviction: bool = False
    redis_check_interval_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.streams:
            raise ConfigError("a worker needs at least one stream")
        if not self.group or not self.consumer:
            raise ConfigError("group and consumer must be non-empty")
        for name in (
            "max_batch_tokens",
            "read_count",
            "claim_idle_ms",
            "max_deliveries",
            "isolate_after_deliveries",
            "max_result_bytes",
            "max_topk",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "max_wait_ms",
            "block_ms",
            "result_maxlen",
            "dead_letter_maxlen",
            "reply_ttl_s",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.durable_replicas < 0 or self.durable_timeout_ms <= 0:
            raise ConfigError("durable_replicas must be >= 0 and durable_timeout_ms > 0")
        if self.redis_check_interval_s <= 0:
            raise ConfigError(f"redis_check_interval_s must be > 0: {self.redis_check_interval_s}")
        if self.drain_timeout_s <= 0 or self.batch_timeout_s <= 0:
            raise ConfigError("drain_timeout_s and batch_timeout_s must be > 0")
        if self.max_topk > MAX_TOPK:
            raise ConfigError(f"max_topk must be at most {MAX_TOPK}, got {self.max_topk}")
        if self.max_jobs is not None and self.max_jobs <= 0:
            raise ConfigError(f"max_jobs must be > 0, got {self.max_jobs}")
        if self.queues:
            names = [q.name for q in self.queues]
            held = [s for q in self.queues for s in q.streams]
            if len(set(names)) != len(names) or len(set(held)) != len(held):
                raise ConfigError("each queue, and each stream, may be named once")
            if set(held) != set(self.streams):
                raise ConfigError("the queues' streams must be the worker's streams")

    @cached_property
    def shares(self) -> tuple[QueueShare, ...]:
        """The queues served, with their weights and streams (one queue unless ``queues``)."""
        if self.queues:
            return self.queues
        return (QueueShare(stream_queue(self.streams[0]) or self.streams[0], self.streams),)

    @cached_property
    def _queue_by_stream(self) -> dict[str, str]:
        return {s: q.name for q in self.shares for s in q.streams}

    def queue_of(self, stream: str) -> str:
        """The name of the queue ``stream`` belongs to (the first queue for any other stream)."""
        return self._queue_by_stream.get(stream, self.shares[0].name)

    @property
    def durability(self) -> Durability:
        """The ``WAIT`` after result writes (``replicas`` 0: off)."""
        return Durability(self.durable_replicas, self.durable_timeout_ms, self.durable_all_results)

    @property
    def lease_interval_s(self) -> float:
        """How often in-flight entries are renewed: a third of the idle limit."""
        return max(self.claim_idle_ms / 3000.0, 0.05)

    @property
    def reclaim_every_s(self) -> float:
        """How often idle entries of dead consumers are looked for."""
        ms = self.reclaim_interval_ms if self.reclaim_interval_ms else self.claim_idle_ms / 2
        return max(ms / 1000.0, 0.05)


__all__ = ["QueueShare", "WorkerConfig", "queue_shares"]
