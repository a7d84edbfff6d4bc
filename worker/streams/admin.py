"""Queue inspection and dead-letter operations (what ``scoring-worker info`` and ``dlq`` run).

Works on one logical queue (all its partitions) and one consumer group; aggregates over
partitions (``total``) and reports each partition. Dead-letter entries are the ones the daemon
writes (fields ``payload``, ``reason``, ``stream``, ``id``, ``deliveries``, ``consumer``,
``at_ms``); replay re-adds the original payload to its job stream and deletes the dead letter. Every
dead-letter function works on all partitions or, with ``partition``, on one of them.
No torch import.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from worker import keys, protocol
from worker.streams.heartbeat import read_heartbeats
from worker.streams.reading import as_text
from worker.streams.stats import stream_stats


def _id_ms(entry_id: Any) -> int:
    return int(as_text(entry_id).split("-", 1)[0])


def server_time_ms(client: Any) -> int:
    """The server's clock in unix ms (entry ids use it, so ages never depend on our clock)."""
    t = client.time()
    if isinstance(t, dict):  # cluster: {node: (s, us)}
        t = next(iter(t.values()))
    seconds, micros = t
    return int(seconds) * 1000 + int(micros) // 1000


def stream_info(client: Any, stream: str, group: str, now_ms: int | None = None) -> dict[str, Any]:
    """One stream and group: length, lag, pending, oldest pending age, consumers with idle time,
    and the depth of its dead-letter stream.

    Length, lag, pending and consumers are :func:`worker.streams.stats.stream_stats` (the
    numbers the worker's gauges export; its docstring says what lag is with no group), in the
    shape of ``scoring-worker info --json``; the oldest pending age (``XPENDING`` summary,
    against the server's clock) and the dead-letter depth are added here.
    """
    now_ms = server_time_ms(client) if now_ms is None else now_ms
    st = stream_stats(client, stream, group)
    dead = keys.dead_letter_stream(stream)
    oldest_pending_age_s = None
    if st["pending"]:
        smallest = client.xpending(stream, group).get("min")
        if smallest:
            oldest_pending_age_s = max(0.0, (now_ms - _id_ms(smallest)) / 1000)
    return {
        "stream": stream,
        "group": group,
        "exists": st["exists"],
        "group_exists": st["group_exists"],
        "length": st["length"],
        "lag": st["lag"],
        "pending": st["pending"],
        "oldest_pending_age_s": oldest_pending_age_s,
        "last_delivered_id": st["last_delivered_id"],
        "consumers": [
            {
                "name": c["name"],
                "pending": c["pending"],
                "idle_s": c["idle_ms"] / 1000,
                "inactive_s": None if c["inactive_ms"] is None else c["inactive_ms"] / 1000,
            }
            for c in st["consumer_details"]
        ],
        "dead_letter_stream": dead,
        "dead_letters": int(client.xlen(dead)),
    }


def queue_info(
    client: Any,
    queue: str = keys.DEFAULT_QUEUE,
    partitions: int = 1,
    group: str = keys.DEFAULT_GROUP,
) -> dict[str, Any]:
    """All partitions of ``queue`` plus totals (lag is None when any partition cannot say), and
    ``workers``: the live workers' heartbeats (what each serves and holds)."""
    now_ms = server_time_ms(client)
    parts = [stream_info(client, s, group, now_ms) for s in keys.job_streams(queue, partitions)]
    lags = [p["lag"] for p in parts]
    ages = [p["oldest_pending_age_s"] for p in parts if p["oldest_pending_age_s"] is not None]
    consumers = {c["name"] for p in parts for c in p["consumers"]}
    total = {
        "length": sum(p["length"] for p in parts),
        "lag": None if any(lag is None for lag in lags) else sum(lags),
        "pending": sum(p["pending"] for p in parts),
        "oldest_pending_age_s": max(ages) if ages else None,
        "consumers": len(consumers),
        "dead_letters": sum(p["dead_letters"] for p in parts),
    }
    return {
        "queue": queue,
        "group": group,
        "partitions": partitions,
        "server_time_ms": now_ms,
        "total": total,
        "streams": parts,
        "workers": read_heartbeats(client, queue),
    }


def known_queues(client: Any, max_keys: int = 100_000) -> list[str]:
    """The queues this server holds a job stream or a worker index for (``SCAN MATCH
    scoring:{*}:jobs`` and ``scoring:{*}:workers``, at most ``max_keys`` keys looked at per
    pattern), sorted. For ``info`` when the queue asked for is not one of them."""
    found: set[str] = set()
    for pattern in keys.QUEUE_KEY_PATTERNS:
        for n, key in enumerate(client.scan_iter(match=pattern, count=1000)):
            if n >= max_keys:
                break
            queue = keys.queue_of_key(as_text(key))
            if queue:
                found.add(queue)
    return sorted(found)


def queue_exists(info: dict[str, Any]) -> bool:
    """Whether a ``queue_info`` result shows the queue at all: a job stream, a group or a live
    worker (an unknown name shows none of them)."""
    streams = info["streams"]
    return bool(info["workers"]) or any(s["exists"] or s["group_exists"] for s in streams)


# ----------------------------------------------------------------------------- dead letters


@dataclass(frozen=True)
class DeadLetterEntry:
    """One dead-lettered job as the daemon recorded it."""

    dlq_stream: str
    dlq_id: str
    job_stream: str
    job_id: str | None
    reason: str
    deliveries: int | None
    consumer: str | None
    dead_at_ms: int
    original_entry_id: str | None
    payload_bytes: int
    partition: int | None = None  # index of the queue partition whose dead-letter stream holds it

    def to_json(self) -> dict[str, Any]:
        """A JSON-friendly dict."""
        return asdict(self)


def _entry(
    dlq: str, job_stream: str, dlq_id: Any, fields: dict[Any, Any], partition: int | None = None
) -> DeadLetterEntry:
    f = {as_text(k): v for k, v in fields.items()}
    payload = f.get("payload") or b""
    envelope = protocol.peek_envelope(payload) if payload else {}
    deliveries = f.get("deliveries")
    at_ms = f.get("at_ms")
    return DeadLetterEntry(
        dlq_stream=dlq,
        dlq_id=as_text(dlq_id),
        job_stream=as_text(f.get("stream", job_stream)),
        job_id=envelope.get("id") or (as_text(f["job_id"]) if "job_id" in f else None),
        reason=as_text(f.get("reason", "")),
        deliveries=int(as_text(deliveries)) if deliveries is not None else None,
        consumer=as_text(f["consumer"]) if "consumer" in f else None,
        dead_at_ms=int(as_text(at_ms)) if at_ms is not None else _id_ms(dlq_id),
        original_entry_id=as_text(f["id"]) if "id" in f else None,
        payload_bytes=len(payload),
        partition=partition,
    )


def _dead_streams(
    queue: str, partitions: int, partition: int | None = None
) -> list[tuple[int, str, str]]:
    """``(partition index, dead-letter stream, job stream)`` of every partition, or of one."""
    streams = keys.job_streams(queue, partitions)
    if partition is not None and not 0 <= partition < len(streams):
        raise ValueError(f"partition must be in 0..{len(streams) - 1}, got {partition}")
    return [
        (i, keys.dead_letter_stream(s), s)
        for i, s in enumerate(streams)
        if partition is None or i == partition
    ]


def dlq_list(
    client: Any,
    queue: str = keys.DEFAULT_QUEUE,
    partitions: int = 1,
    *,
    limit: int = 100,
    partition: int | None = None,
) -> list[DeadLetterEntry]:
    """Up to ``limit`` dead letters per partition (of every partition, or of ``partition``),
    oldest first, partition by partition."""
    out: list[DeadLetterEntry] = []
    for i, dlq, job_stream in _dead_streams(queue, partitions, partition):
        for dlq_id, fields in client.xrange(dlq, count=limit):
            out.append(_entry(dlq, job_stream, dlq_id, fields, i))
    return out


def dlq_counts(
    client: Any,
    queue: str = keys.DEFAULT_QUEUE,
    partitions: int = 1,
    *,
    partition: int | None = None,
) -> dict[str, Any]:
    """How many dead letters each partition holds (every partition, or ``partition``) and in
    total: ``{"queue", "partitions", "total", "by_partition": [{"partition", "stream",
    "dead_letter_stream", "dead_letters"}]}``."""
    rows = [
        {
            "partition": i,
            "stream": job_stream,
            "dead_letter_stream": dlq,
            "dead_letters": int(client.xlen(dlq)),
        }
        for i, dlq, job_stream in _dead_streams(queue, partitions, partition)
    ]
    return {
        "queue": queue,
        "partitions": partitions,
        "total": sum(r["dead_letters"] for r in rows),
        "by_partition": rows,
    }


def _matches(entry: DeadLetterEntry, ids: set[str] | None) -> bool:
    return ids is None or entry.dlq_id in ids or (entry.job_id is not None and entry.job_id in ids)


def dlq_replay(
    client: Any,
    queue: str = keys.DEFAULT_QUEUE,
    partitions: int = 1,
    *,
    ids: Iterable[str] | None = None,
    batch: int = 500,
    partition: int | None = None,
) -> list[DeadLetterEntry]:
    """Re-add dead letters to their job streams and delete them from the dead-letter stream.

    ``ids`` selects by job id or dead-letter entry id (None: all); ``partition`` limits it to one
    partition. Each move is one MULTI (the two keys share a hash tag, so this works on Cluster).
    Returns the entries replayed.
    """
    wanted = set(ids) if ids is not None else None
    replayed: list[DeadLetterEntry] = []
    for i, dlq, job_stream in _dead_streams(queue, partitions, partition):
        start = "-"
        while True:
            chunk = client.xrange(dlq, min=start, count=batch)
            if not chunk:
                break
            for dlq_id, fields in chunk:
                entry = _entry(dlq, job_stream, dlq_id, fields, i)
                payload = fields.get(b"payload") or fields.get("payload")
                if not payload or not _matches(entry, wanted):
                    continue
                target = entry.job_stream if entry.job_stream else job_stream
                if not keys.same_slot(target, dlq):
                    target = job_stream
                pipe = client.pipeline(transaction=True)
                pipe.xadd(target, {protocol.PAYLOAD_FIELD: payload})
                pipe.xdel(dlq, dlq_id)
                pipe.execute()
                replayed.append(entry)
            last = as_text(chunk[-1][0])
            start = "(" + last
            if len(chunk) < batch:
                break
    return replayed


def dlq_purge(
    client: Any,
    queue: str = keys.DEFAULT_QUEUE,
    partitions: int = 1,
    *,
    ids: Iterable[str] | None = None,
    partition: int | None = None,
) -> int:
    """Delete dead letters (all, or those matching ``ids``; of every partition, or of
    ``partition``); returns how many were deleted."""
    if ids is None:
        total = 0
        for _, dlq, _ in _dead_streams(queue, partitions, partition):
            total += int(client.xlen(dlq))
            client.delete(dlq)
        return total
    wanted = set(ids)
    deleted = 0
    for entry in dlq_list(client, queue, partitions, limit=1_000_000, partition=partition):
        if _matches(entry, wanted):
            deleted += int(client.xdel(entry.dlq_stream, entry.dlq_id))
    return deleted


__all__ = [
    "DeadLetterEntry",
    "dlq_counts",
    "dlq_list",
    "dlq_purge",
    "dlq_replay",
    "queue_info",
    "server_time_ms",
    "stream_info",
]
