"""Redis Streams commands of the worker: the only worker-side module that speaks them.

Everything here is a thin, typed function over one client (``redis.Redis`` or
``redis.RedisCluster``) so the daemon reads as logic, not as wire commands:

* :func:`ensure_group` - ``XGROUP CREATE ... MKSTREAM`` tolerating only ``BUSYGROUP``;
* :func:`read_new` - ``XREADGROUP`` over one or more streams, fair over partitions, no CROSSSLOT;
* :func:`write_results` - result ``XADD`` + ``XACK``, atomic (one script per job) when the reply
  stream shares the job stream's slot, else ``XADD`` then ``XACK`` (never ack before the result);
* :func:`renew_leases` - ``XCLAIM ... JUSTID`` of entries this consumer still owns;
* :func:`reclaim_idle` - ``XAUTOCLAIM`` (Redis >= 7 / Valkey) or ``XPENDING`` + ``XCLAIM``;
* :func:`dead_letter` - ``XADD`` to the dead-letter stream + ``XACK`` in one script;
* :func:`stream_stats` - ``XLEN``, ``XINFO GROUPS`` (lag, pending), ``XINFO CONSUMERS``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from worker.keys import same_slot
from worker.protocol import PAYLOAD_FIELD

# Result write + ack in one atomic step. KEYS: reply stream, job stream.
# ARGV: group, entry id, payload, maxlen. An unusable reply stream (wrong type) leaves the
# entry pending and returns the error, so a result is never acked away unwritten.
_RESULT_ACK = """
if ARGV[5] ~= '' then
  local p = redis.call('XPENDING', KEYS[2], ARGV[1], ARGV[2], ARGV[2], 1)
  if #p > 0 and p[1][2] ~= ARGV[5] then return {2, p[1][2]} end
end
local id = redis.pcall('XADD', KEYS[1], 'MAXLEN', '~', ARGV[4], '*', 'payload', ARGV[3])
if type(id) == 'table' and id.err then return {0, id.err} end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
return {1, id}
"""

# Dead-letter + ack in one atomic step. KEYS: dead stream, job stream.
# ARGV: group, entry id, maxlen, then field/value pairs.
_DEAD_ACK = """
local args = {'XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*'}
for i = 4, #ARGV do args[#args + 1] = ARGV[i] end
local id = redis.call(unpack(args))
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
return id
"""


@dataclass
class Entry:
    """One job stream entry as delivered to this consumer."""

    stream: str
    id: str
    payload: bytes | None  # None when the entry has no ``payload`` field
    deliveries: int = 1

    @property
    def enqueued_ms(self) -> int:
        """Unix ms at which the entry was added (the ms part of its id)."""
        try:
            return int(self.id.split("-", 1)[0])
        except ValueError:
            return 0


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _entry(stream: str, entry_id: Any, fields: Any, deliveries: int = 1) -> Entry:
    payload = None
    if isinstance(fields, dict):
        payload = fields.get(PAYLOAD_FIELD, fields.get(PAYLOAD_FIELD.decode()))
        if isinstance(payload, str):
            payload = payload.encode()
    return Entry(stream=stream, id=_s(entry_id), payload=payload, deliveries=deliveries)


def is_cluster(client: Any) -> bool:
    """True for a ``redis.RedisCluster`` client."""
    return isinstance(client, redis.RedisCluster)


def server_version(client: Any) -> tuple[int, int, int]:
    """(major, minor, patch) of the server (Valkey reports a Redis-compatible version)."""
    from worker.connections import server_version as _version

    return _version(client)


def supports_autoclaim(version: tuple[int, int, int]) -> bool:
    """XAUTOCLAIM exists from Redis 6.2; we use it from 7.0, whose reply (3 elements, deleted
    ids removed from the PEL) redis-py parses safely. Older servers use XPENDING + XCLAIM."""
    return version >= (7, 0, 0)


# ----------------------------------------------------------------------------- groups


def ensure_group(client: Any, stream: str, group: str, start_id: str = "0") -> bool:
    """Create ``group`` on ``stream`` (creating the stream). True if created, False if it existed.

    Only ``BUSYGROUP`` is tolerated; any other error propagates.
    """
    try:
        client.xgroup_create(stream, group, id=start_id, mkstream=True)
        return True
    except redis.ResponseError as exc:
        if str(exc).startswith("BUSYGROUP"):
            return False
        raise


def is_nogroup(exc: BaseException) -> bool:
    """True for the error Redis raises when the stream or group is gone (e.g. after a flush)."""
    if not isinstance(exc, redis.ResponseError):
        return False
    msg = str(exc)
    # a blocked XREADGROUP whose stream is deleted gets "UNBLOCKED the stream key no longer exists"
    return msg.startswith("NOGROUP") or (msg.startswith("UNBLOCKED") and "no longer" in msg)


# ----------------------------------------------------------------------------- reading


def read_new(
    client: Any,
    streams: Sequence[str],
    group: str,
    consumer: str,
    *,
    count: int,
    block_ms: int | None,
    rotation: int = 0,
) -> list[Entry]:
    """Read never-delivered entries (``>``) from ``streams``.

    ``rotation`` rotates the order so no partition is always served first. On a standalone server
    one ``XREADGROUP`` covers every stream; on Cluster (keys in different slots) each stream is
    read on its own without blocking, and only if all are empty one of them (by rotation) blocks.
    ``block_ms=None`` or 0 means do not block.
    """
    if not streams:
        return []
    k = rotation % len(streams)
    ordered = list(streams[k:]) + list(streams[:k])
    block = block_ms if block_ms else None
    if not is_cluster(client) or len(ordered) == 1:
        reply = client.xreadgroup(
            group, consumer, {s: ">" for s in ordered}, count=count, block=block
        )
        return _parse_read(reply)
    out: list[Entry] = []
    for s in ordered:
        out.extend(_parse_read(client.xreadgroup(group, consumer, {s: ">"}, count=count)))
    if not out and block:
        reply = client.xreadgroup(group, consumer, {ordered[0]: ">"}, count=count, block=block)
        out = _parse_read(reply)
    return out


def _parse_read(reply: Any) -> list[Entry]:
    out: list[Entry] = []
    if not reply:
        return out
    items = reply.items() if isinstance(reply, dict) else reply  # RESP3 returns a map
    for stream, entries in items:
        if isinstance(entries, list) and entries and isinstance(entries[0], list):
            entries = entries[0]  # RESP3 nests one level deeper
        name = _s(stream)
        for entry_id, fields in entries or []:
            out.append(_entry(name, entry_id, fields))
    return out


def pending_count(client: Any, stream: str, group: str, consumer: str | None = None) -> int:
    """Entries pending in ``group`` (of ``consumer`` only when given)."""
    if consumer is None:
        return int(client.xpending(stream, group)["pending"])
    rows = client.xpending_range(stream, group, "-", "+", 1000, consumername=consumer)
    return len(rows)


# ----------------------------------------------------------------------------- writing


@dataclass
class Delivery:
    """One result to write for one job entry (``reply_to`` None: nothing to write, ack only)."""

    stream: str
    entry_id: str
    reply_to: str | None
    payload: bytes | None


def write_results(
    client: Any,
    group: str,
    deliveries: Sequence[Delivery],
    *,
    maxlen: int,
    consumer: str = "",
    superseded: list[Delivery] | None = None,
) -> list[tuple[Delivery, str]]:
    """Write every result and ack its entry; returns ``(delivery, error)`` for those that failed.

    With ``consumer`` set, the atomic script first checks who holds the entry: when another
    consumer has taken it over (this worker was paused past the claim idle time), nothing is
    written, since the new holder answers it; such deliveries go to ``superseded``. An entry
    that is no longer pending at all is still answered (at-least-once wins over de-duplication).

    A result whose reply stream shares the job stream's slot goes in with its ack in one atomic
    script call; otherwise the result ``XADD`` completes before the ``XACK`` is sent. All calls of
    one batch share one pipeline (one round trip). A failed write leaves its entry pending.
    """
    failures: list[tuple[Delivery, str]] = []
    if not deliveries:
        return failures
    atomic: list[Delivery] = []
    split: list[Delivery] = []
    ack_only: list[Delivery] = []
    cluster = is_cluster(client)
    for d in deliveries:
        if d.reply_to is None or d.payload is None:
            ack_only.append(d)
        elif not cluster or same_slot(d.reply_to, d.stream):
            atomic.append(d)
        else:
            split.append(d)
    pipe = client.pipeline(transaction=False)
    atomic_replies: list[Any] = []
    if cluster:  # redis-py's ClusterPipeline has no EVAL: one script call per result
        for d in atomic:
            try:
                atomic_replies.append(
                    client.eval(
                        _RESULT_ACK,
                        2,
                        d.reply_to,
                        d.stream,
                        group,
                        d.entry_id,
                        d.payload,
                        maxlen,
                        consumer,
                    )
                )
            except redis.ResponseError as exc:
                atomic_replies.append(exc)
    else:
        for d in atomic:
            pipe.eval(
                _RESULT_ACK, 2, d.reply_to, d.stream, group, d.entry_id, d.payload, maxlen,
                consumer,
            )  # fmt: skip
    for d in split:
        pipe.xadd(d.reply_to, {PAYLOAD_FIELD: d.payload}, maxlen=maxlen, approximate=True)
    queued = split or (atomic and not cluster)
    replies = pipe.execute(raise_on_error=False) if queued else []
    if not cluster:
        atomic_replies, replies = replies[: len(atomic)], replies[len(atomic) :]
    to_ack = list(ack_only)
    for d, reply in zip(atomic, atomic_replies, strict=True):
        if isinstance(reply, Exception):
            failures.append((d, str(reply)))
        elif int(reply[0]) == 2:
            if superseded is not None:
                superseded.append(d)
        elif not int(reply[0]):
            failures.append((d, _s(reply[1])))
    for d, reply in zip(split, replies, strict=True):
        if isinstance(reply, Exception):
            failures.append((d, str(reply)))
        else:
            to_ack.append(d)
    ack(client, group, [(d.stream, d.entry_id) for d in to_ack])
    return failures


def ack(client: Any, group: str, entries: Iterable[tuple[str, str]]) -> None:
    """``XACK`` entries, one command per stream."""
    by_stream: dict[str, list[str]] = {}
    for stream, entry_id in entries:
        by_stream.setdefault(stream, []).append(entry_id)
    if not by_stream:
        return
    pipe = client.pipeline(transaction=False)
    for stream, ids in by_stream.items():
        pipe.xack(stream, group, *ids)
    pipe.execute()


def dead_letter(
    client: Any,
    group: str,
    entry: Entry,
    dead_stream: str,
    *,
    reason: str,
    consumer: str,
    maxlen: int,
) -> None:
    """Move ``entry`` to ``dead_stream`` (fields: payload, reason, stream, id, deliveries,
    consumer, at_ms) and ack it, atomically when the two keys share a slot."""
    fields: list[Any] = [
        "payload",
        entry.payload if entry.payload is not None else b"",
        "reason",
        reason,
        "stream",
        entry.stream,
        "id",
        entry.id,
        "deliveries",
        entry.deliveries,
        "consumer",
        consumer,
        "at_ms",
        int(time.time() * 1000),
    ]
    if not is_cluster(client) or same_slot(dead_stream, entry.stream):
        client.eval(_DEAD_ACK, 2, dead_stream, entry.stream, group, entry.id, maxlen, *fields)
        return
    client.xadd(
        dead_stream, dict(zip(fields[::2], fields[1::2], strict=True)), maxlen=maxlen,
        approximate=True,
    )  # fmt: skip
    client.xack(entry.stream, group, entry.id)


# ----------------------------------------------------------------------------- leases and reclaim


def renew_leases(
    client: Any, stream: str, group: str, consumer: str, entry_ids: Sequence[str]
) -> list[str]:
    """Reset the idle time of ``entry_ids`` that this consumer still owns (``XCLAIM ... JUSTID``,
    which does not bump the delivery count). Entries another consumer took over are left alone.
    Returns the renewed ids."""
    if not entry_ids:
        return []
    lo = min(entry_ids, key=_id_key)
    hi = max(entry_ids, key=_id_key)
    owned_rows = client.xpending_range(stream, group, lo, hi, len(entry_ids) + 1024, consumer)
    owned = {_s(r["message_id"]) for r in owned_rows}
    ids = [i for i in entry_ids if i in owned]
    if not ids:
        return []
    claimed = client.xclaim(stream, group, consumer, 0, ids, justid=True)
    return [_s(i) for i in claimed]


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def reclaim_idle(
    client: Any,
    stream: str,
    group: str,
    consumer: str,
    *,
    min_idle_ms: int,
    count: int,
    use_autoclaim: bool,
) -> tuple[list[Entry], list[str]]:
    """Take over entries idle longer than ``min_idle_ms`` (their consumer died).

    Returns ``(entries, deleted_ids)``: the claimed entries with their delivery counts (already
    bumped by the claim), and ids that were pending but deleted from the stream (trimmed).
    """
    deleted: list[str] = []
    claimed: list[Entry] = []
    if use_autoclaim:
        start = "0-0"
        while len(claimed) < count:
            reply = client.xautoclaim(
                stream, group, consumer, min_idle_ms, start_id=start, count=count - len(claimed)
            )
            start = _s(reply[0])
            for entry_id, fields in reply[1]:
                if entry_id is None:
                    continue
                claimed.append(_entry(stream, entry_id, fields))
            if len(reply) > 2:
                deleted.extend(_s(i) for i in reply[2] or [])
            if start == "0-0":
                break
    else:
        rows = client.xpending_range(stream, group, "-", "+", count * 4)
        ids = [_s(r["message_id"]) for r in rows if r["time_since_delivered"] >= min_idle_ms]
        if ids:
            for entry_id, fields in client.xclaim(stream, group, consumer, min_idle_ms, ids):
                if entry_id is not None and fields is not None:
                    claimed.append(_entry(stream, entry_id, fields))
            got = {e.id for e in claimed}
            deleted = [i for i in ids if i not in got and not client.xrange(stream, i, i)]
            if deleted:
                client.xack(stream, group, *deleted)
    if claimed:
        counts = delivery_counts(client, stream, group, [e.id for e in claimed])
        for e in claimed:
            e.deliveries = counts.get(e.id, e.deliveries)
    return claimed, deleted


def delivery_counts(
    client: Any, stream: str, group: str, entry_ids: Sequence[str]
) -> dict[str, int]:
    """Delivery count of each pending entry id (``XPENDING`` range)."""
    if not entry_ids:
        return {}
    lo = min(entry_ids, key=_id_key)
    hi = max(entry_ids, key=_id_key)
    rows = client.xpending_range(stream, group, lo, hi, len(entry_ids) + 1024)
    wanted = set(entry_ids)
    return {
        _s(r["message_id"]): int(r["times_delivered"])
        for r in rows
        if _s(r["message_id"]) in wanted
    }


# ----------------------------------------------------------------------------- stats


def stream_stats(client: Any, stream: str, group: str) -> dict[str, Any]:
    """Length, group lag/pending/consumers and per-consumer pending/idle of one stream.

    Returns ``{"stream", "group", "length", "exists", "group_exists", "lag", "pending",
    "consumers", "last_delivered_id", "consumer_details": [{name, pending, idle_ms}]}``.
    ``lag`` is ``None`` when the server cannot say (Redis < 7 or a trimmed stream).
    """
    out: dict[str, Any] = {
        "stream": stream,
        "group": group,
        "length": 0,
        "exists": False,
        "group_exists": False,
        "lag": None,
        "pending": 0,
        "consumers": 0,
        "last_delivered_id": None,
        "consumer_details": [],
    }
    out["length"] = int(client.xlen(stream))
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:  # no such key
        return out
    out["exists"] = True
    for g in groups:
        if _s(g.get("name")) != group:
            continue
        out["group_exists"] = True
        out["pending"] = int(g.get("pending", 0))
        out["consumers"] = int(g.get("consumers", 0))
        lag = g.get("lag")
        out["lag"] = int(lag) if lag is not None else None
        if lag is None and _s(g.get("last-delivered-id", "")) in ("0-0", "0"):
            out["lag"] = out["length"]
        out["last_delivered_id"] = _s(g.get("last-delivered-id", ""))
        out["consumer_details"] = [
            {
                "name": _s(c.get("name")),
                "pending": int(c.get("pending", 0)),
                "idle_ms": int(c.get("idle", 0)),
            }
            for c in client.xinfo_consumers(stream, group)
        ]
    return out
