"""Redis Streams commands of the worker: the only worker-side package that speaks them.

Everything here is a thin, typed function over one client (``redis.Redis`` or
``redis.RedisCluster``) so the daemon reads as logic, not as wire commands. Callers use the
names below through this package (``from worker import streams``; ``streams.read_new(...)``);
each lives in the module named beside it.

Functions and the Redis commands they send:

* :func:`ensure_group` (``groups``) - ``XGROUP CREATE ... MKSTREAM`` tolerating only ``BUSYGROUP``;
* :func:`read_new` (``reading``) - ``XREADGROUP`` over one or more streams, fair over
  partitions, no CROSSSLOT;
* :func:`write_results` (``writing``) - result ``XADD`` + ``XACK``, atomic (script
  ``RESULT_ACK``, one per job) when the reply stream shares the job stream's slot, else ``XADD``
  then ``XACK`` (never ack before the result); with a :class:`Durability` (``durable``)
  each node's writes are followed by ``WAIT replicas timeout`` on the same connection and the
  two-step path acks only what a replica acknowledged;
* :func:`ack` (``writing``) - ``XACK``, one command per stream;
* :func:`dead_letter` (``writing``) - ``XADD`` to the dead-letter stream + the producer's error
  result + ``XACK`` in one script (``DEAD_ACK``);
* :func:`renew_leases` (``claims``) - ``XCLAIM ... JUSTID`` of entries this consumer still owns
  (script ``RENEW``);
* :func:`reclaim_idle` (``claims``) - ``XAUTOCLAIM`` (Redis >= 7 / Valkey) or
  ``XPENDING ... IDLE`` + ``XCLAIM``;
* :func:`delivery_counts` (``claims``), :func:`pending_count` (``groups``) - ``XPENDING``;
* :func:`forget_consumer` (``groups``) - ``XGROUP DELCONSUMER`` when it holds nothing (script
  ``FORGET``);
* :func:`hand_back` (``handback``) - a draining worker's unstarted entries made claimable at once
  (script ``HANDBACK``: ``XCLAIM ... IDLE ... RETRYCOUNT ... JUSTID`` + ``HINCRBY``);
  :func:`handback_marks` - ``HGETALL`` of the hand-back hashes the other workers poll;
  :func:`forget_givers` - ``FORGET`` + ``HDEL`` of givers that hold nothing any more;
* :func:`stream_stats` (``stats``) - ``XLEN``, ``XINFO GROUPS`` (lag, pending), ``XINFO
  CONSUMERS``: the one source of the worker's stream gauges and of ``scoring-worker info``;
* :func:`server_version` (``groups``) - ``INFO server``;
* :func:`write_heartbeat` (``heartbeat``) - ``HSET`` + ``PEXPIRE`` of the worker's heartbeat hash,
  ``ZADD`` + ``ZREMRANGEBYSCORE`` + ``PEXPIRE`` of the queue's worker index (one pipeline, one
  slot); :func:`read_heartbeats` - ``ZRANGE`` + ``HGETALL`` + ``PTTL`` (``scoring-worker info``).

Lua scripts (``scripts``), each one atomic check-then-write step:

* ``RESULT_ACK`` - KEYS: reply stream, job stream. ARGV: group, entry id, payload, maxlen,
  consumer ('' = no ownership check), reply TTL in s ('0' = none);
* ``DEAD_ACK`` - KEYS: dead stream, job stream[, reply stream]. ARGV: group, entry id, maxlen,
  consumer, result payload ('' = none), result maxlen, reply TTL in s, field/value pairs...;
* ``RENEW`` - KEYS: job stream. ARGV: group, consumer, entry ids...;
* ``FORGET`` - KEYS: job stream. ARGV: group, consumer;
* ``HANDBACK`` - KEYS: job stream, hand-back hash. ARGV: group, consumer, idle ms, hash TTL in
  ms, entry ids....

Errors (``transient``): :func:`is_transient` says which refusals to retry later
(:data:`TRANSIENT_ERRORS`, raised as :class:`TransientRedisError`), :func:`error_text` puts back
the code redis-py strips, :func:`is_nogroup` spots a stream or group that is gone.

Queue inspection and dead-letter operations for ``scoring-worker info``/``dlq`` are in
:mod:`worker.streams.admin`.
"""

from __future__ import annotations

from worker.streams.claims import delivery_counts, reclaim_idle, renew_leases
from worker.streams.durable import Durability
from worker.streams.groups import (
    ensure_group,
    forget_consumer,
    is_cluster,
    pending_count,
    server_version,
    supports_autoclaim,
    trim_acked,
)
from worker.streams.handback import forget_givers, hand_back, handback_marks
from worker.streams.heartbeat import read_heartbeats, write_heartbeat
from worker.streams.reading import Entry, read_new
from worker.streams.stats import stream_stats
from worker.streams.transient import (
    TRANSIENT_ERRORS,
    TransientRedisError,
    error_text,
    is_nogroup,
    is_transient,
)
from worker.streams.writing import Delivery, ack, dead_letter, write_results

__all__ = [
    "TRANSIENT_ERRORS",
    "Delivery",
    "Durability",
    "Entry",
    "TransientRedisError",
    "ack",
    "dead_letter",
    "delivery_counts",
    "ensure_group",
    "error_text",
    "forget_consumer",
    "forget_givers",
    "hand_back",
    "handback_marks",
    "is_cluster",
    "is_nogroup",
    "is_transient",
    "pending_count",
    "read_heartbeats",
    "read_new",
    "reclaim_idle",
    "renew_leases",
    "server_version",
    "stream_stats",
    "supports_autoclaim",
    "trim_acked",
    "write_heartbeat",
    "write_results",
]
