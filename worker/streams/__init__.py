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

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from worker.keys import same_slot
from worker.protocol import PAYLOAD_FIELD

# Result write + ack in one atomic step. KEYS: reply stream, job stream.
# ARGV: group, entry id, payload, maxlen, consumer ('' = no ownership check), reply TTL in s
# ('0' = none). An unusable reply stream (wrong type) leaves the entry pending and returns the
# error, so a result is never acked away unwritten. A reply stream with no TTL gets one (a
# late result after its client closed must not leave a key behind forever); a TTL the client
# set is left alone.
_RESULT_ACK = """
if ARGV[5] ~= '' then
  local p = redis.call('XPENDING', KEYS[2], ARGV[1], ARGV[2], ARGV[2], 1)
  if #p > 0 and p[1][2] ~= ARGV[5] then return {2, p[1][2]} end
end
local id = redis.pcall('XADD', KEYS[1], 'MAXLEN', '~', ARGV[4], '*', 'payload', ARGV[3])
if type(id) == 'table' and id.err then return {0, id.err} end
if ARGV[6] ~= '0' and redis.call('TTL', KEYS[1]) == -1 then
  redis.call('EXPIRE', KEYS[1], ARGV[6])
end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
return {1, id}
"""

# Dead-letter + (optional) producer's dead_letter result + ack in one atomic step.
# KEYS: dead stream, job stream[, reply stream]. ARGV: group, entry id, maxlen, consumer,
# result payload ('' for none), result maxlen, reply TTL, then field/value pairs. Like
# _RESULT_ACK it first
# checks who holds the entry (another consumer took it over: nothing is done) and leaves the
# entry pending when the dead-letter XADD fails. A failed result write is reported, not fatal.
_DEAD_ACK = """
if ARGV[4] ~= '' then
  local p = redis.call('XPENDING', KEYS[2], ARGV[1], ARGV[2], ARGV[2], 1)
  if #p > 0 and p[1][2] ~= ARGV[4] then return {2, p[1][2]} end
end
local args = {'XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*'}
for i = 8, #ARGV do args[#args + 1] = ARGV[i] end
local id = redis.pcall(unpack(args))
if type(id) == 'table' and id.err then return {0, id.err} end
local note = ''
if KEYS[3] and ARGV[5] ~= '' then
  local r = redis.pcall('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'payload', ARGV[5])
  if type(r) == 'table' and r.err then
    note = r.err
  elseif ARGV[7] ~= '0' and redis.call('TTL', KEYS[3]) == -1 then
    redis.call('EXPIRE', KEYS[3], ARGV[7])
  end
end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
return {1, note}
"""

# Lease renewal: reset the idle time of the given ids this consumer still owns, atomically
# with the ownership check. KEYS: job stream. ARGV: group, consumer, ids...
_RENEW = """
local out = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p > 0 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    out[#out + 1] = ARGV[i]
  end
end
return out
"""

# Forget this consumer when it holds nothing. KEYS: job stream. ARGV: group, consumer.
_FORGET = """
local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if type(p) == 'table' and p.err then return -1 end
if #p > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# Errors a Redis server answers while it cannot take writes for a while (memory full, a
# replica being promoted, a script running long, a cluster resharding or failing over). A
# write that got one is retried later, never treated as a bad reply stream.
TRANSIENT_ERRORS = ("OOM", "READONLY", "BUSY", "TRYAGAIN", "CLUSTERDOWN", "LOADING",
                    "MASTERDOWN", "NOREPLICAS", "MOVED", "ASK", "CONNECTION",
                    "TIMEOUT")  # fmt: skip


class TransientRedisError(redis.ConnectionError):
    """A write the server refused for now (see :data:`TRANSIENT_ERRORS`); retried with backoff
    like a lost connection."""


_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    redis.ConnectionError,  # BusyLoadingError (LOADING) is one
    redis.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,  # MasterDownError is one
    redis.exceptions.AskError,  # MovedError is one
)


_CODES: tuple[tuple[type[BaseException], str], ...] = (
    (redis.exceptions.OutOfMemoryError, "OOM"),
    (redis.exceptions.ReadOnlyError, "READONLY"),
    (redis.exceptions.BusyLoadingError, "LOADING"),
    (redis.exceptions.TryAgainError, "TRYAGAIN"),
    (redis.exceptions.MasterDownError, "MASTERDOWN"),
    (redis.exceptions.ClusterDownError, "CLUSTERDOWN"),
    (redis.exceptions.MovedError, "MOVED"),
    (redis.exceptions.AskError, "ASK"),
    (redis.ConnectionError, "CONNECTION"),
    (redis.TimeoutError, "TIMEOUT"),
)


def error_text(error: BaseException) -> str:
    """``str(error)`` with the Redis error code put back where redis-py took it off."""
    for cls, code in _CODES:
        if isinstance(error, cls):
            return f"{code} {error}"
    return str(error)


def is_transient(error: BaseException | str) -> bool:
    """True when ``error`` (an exception or a Redis error string, as a script's ``pcall``
    returns it) is one to retry later. redis-py strips the code from the messages of the errors
    it maps to a class, hence the class check."""
    if isinstance(error, BaseException):
        if isinstance(error, _TRANSIENT_TYPES):
            return True
        if not isinstance(error, redis.ResponseError):
            return False
    code = str(error).lstrip("-").split(" ", 1)[0].upper()
    return code in TRANSIENT_ERRORS


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
    reply_ttl_s: int = 0,
) -> list[tuple[Delivery, str]]:
    """Write every result and ack its entry; returns ``(delivery, error)`` for those that failed.

    With ``consumer`` set, the atomic script first checks who holds the entry: when another
    consumer has taken it over (this worker was paused past the claim idle time), nothing is
    written, since the new holder answers it; such deliveries go to ``superseded``. An entry
    that is no longer pending at all is still answered (at-least-once wins over de-duplication).

    A result whose reply stream shares the job stream's slot goes in with its ack in one atomic
    script call; otherwise the result ``XADD`` completes before the ``XACK`` is sent. All calls of
    one batch share one pipeline (one round trip). A failed write leaves its entry pending; the
    error text keeps its Redis code (``OOM ...``), see :func:`is_transient`.

    ``reply_ttl_s`` > 0 gives a reply stream that has no TTL one, so a result that arrives after
    its client closed (a duplicate, a DLQ replay) does not leave a key behind forever; a TTL the
    client keeps refreshing is left alone. (On the non-atomic cross-slot path the TTL is set
    with ``EXPIRE`` after the write, on servers that have ``EXPIRE ... NX``: Redis >= 7.)
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
                        reply_ttl_s,
                    )
                )
            except (redis.ResponseError, redis.ConnectionError) as exc:
                atomic_replies.append(exc)
    else:
        for d in atomic:
            pipe.eval(
                _RESULT_ACK, 2, d.reply_to, d.stream, group, d.entry_id, d.payload, maxlen,
                consumer, reply_ttl_s,
            )  # fmt: skip
    for d in split:
        pipe.xadd(d.reply_to, {PAYLOAD_FIELD: d.payload}, maxlen=maxlen, approximate=True)
    queued = split or (atomic and not cluster)
    replies = pipe.execute(raise_on_error=False) if queued else []
    if not cluster:
        atomic_replies, replies = replies[: len(atomic)], replies[len(atomic) :]
    if split and reply_ttl_s > 0:
        for d, reply in zip(split, replies, strict=True):
            if not isinstance(reply, Exception):
                with contextlib.suppress(redis.ResponseError):  # EXPIRE NX: Redis >= 7
                    client.expire(d.reply_to, reply_ttl_s, nx=True)
    to_ack = list(ack_only)
    for d, reply in zip(atomic, atomic_replies, strict=True):
        if isinstance(reply, Exception):
            failures.append((d, error_text(reply)))
        elif int(reply[0]) == 2:
            if superseded is not None:
                superseded.append(d)
        elif not int(reply[0]):
            failures.append((d, _s(reply[1])))
    for d, reply in zip(split, replies, strict=True):
        if isinstance(reply, Exception):
            failures.append((d, error_text(reply)))
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
    reply_to: str | None = None,
    result: bytes | None = None,
    result_maxlen: int | None = None,
    reply_ttl_s: int = 0,
) -> str:
    """Move ``entry`` to ``dead_stream`` (fields: payload, reason, stream, id, deliveries,
    consumer, at_ms), write ``result`` (the producer's ``dead_letter`` error) to ``reply_to``
    when given, and ack the entry.

    Where the keys share a slot (always on a standalone server) this is one script: it first
    checks that ``consumer`` still holds the entry (returns ``"superseded"`` and does nothing
    when another consumer took it over), and it leaves the entry pending when the dead-letter
    write fails (raising :class:`TransientRedisError` for a refusal to retry, else
    ``redis.ResponseError``). A result that cannot be written does not stop the dead-lettering
    (the return value then says ``"ok; result not written: ..."``). Returns ``"ok"`` otherwise.
    """
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
    cluster = is_cluster(client)
    with_reply = reply_to is not None and result is not None
    if not cluster or (
        same_slot(dead_stream, entry.stream)
        and (not with_reply or same_slot(str(reply_to), entry.stream))
    ):
        keys = [dead_stream, entry.stream] + ([str(reply_to)] if with_reply else [])
        reply = client.eval(
            _DEAD_ACK, len(keys), *keys, group, entry.id, maxlen, consumer,
            result if with_reply else b"", result_maxlen or maxlen, reply_ttl_s, *fields,
        )  # fmt: skip
        code, detail = int(reply[0]), _s(reply[1])
        if code == 2:
            return "superseded"
        if code == 0:
            if is_transient(detail):
                raise TransientRedisError(detail)
            raise redis.ResponseError(detail)
        return f"ok; result not written: {detail}" if detail else "ok"
    # Keys in different Cluster slots: result, dead letter, then ack (never ack first).
    note = "ok"
    if with_reply:
        try:
            client.xadd(
                reply_to, {PAYLOAD_FIELD: result}, maxlen=result_maxlen or maxlen,
                approximate=True,
            )  # fmt: skip
        except redis.ResponseError as exc:
            if is_transient(exc):
                raise TransientRedisError(str(exc)) from exc
            note = f"ok; result not written: {exc}"
    try:
        client.xadd(
            dead_stream, dict(zip(fields[::2], fields[1::2], strict=True)), maxlen=maxlen,
            approximate=True,
        )  # fmt: skip
    except redis.ResponseError as exc:
        if is_transient(exc):
            raise TransientRedisError(str(exc)) from exc
        raise
    client.xack(entry.stream, group, entry.id)
    return note


def forget_consumer(client: Any, stream: str, group: str, consumer: str) -> bool:
    """Delete ``consumer`` from ``group`` if it holds no pending entry (atomic check-and-delete),
    so a fleet whose pods come and go does not pile up dead consumer names. True if deleted."""
    return int(client.eval(_FORGET, 1, stream, group, consumer)) == 1


# ----------------------------------------------------------------------------- leases and reclaim


def renew_leases(
    client: Any, stream: str, group: str, consumer: str, entry_ids: Sequence[str]
) -> list[str]:
    """Reset the idle time of ``entry_ids`` that this consumer still owns (``XCLAIM ... JUSTID``,
    which does not bump the delivery count). Entries another consumer took over are left alone.
    Returns the renewed ids."""
    if not entry_ids:
        return []
    # One script: the ownership check and the claim cannot be split by another consumer's
    # XAUTOCLAIM (which would otherwise be taken back from it).
    renewed = client.eval(_RENEW, 1, stream, group, consumer, *entry_ids)
    return [_s(i) for i in renewed or []]


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
    isolate_after: int | None = None,
    take_suspect: bool = True,
    waiting: list[str] | None = None,
) -> tuple[list[Entry], list[str]]:
    """Take over entries idle longer than ``min_idle_ms`` (their consumer died).

    Returns ``(entries, deleted_ids)``: the claimed entries with their delivery counts (already
    bumped by the claim), and ids that were pending but deleted from the stream (trimmed).

    With ``isolate_after`` set, entries already delivered that many times are *suspects* (their
    batch never finished, maybe because one of them kills the worker). Every claim bumps the
    delivery count of everything claimed, so claiming suspects in bulk would let one poison
    job that crashes the worker push its unattempted batch-mates to ``max_deliveries`` too.
    Suspects are therefore claimed one at a time (none when ``take_suspect`` is false); the
    ids of those left idle go to ``waiting``.
    """
    deleted: list[str] = []
    claimed: list[Entry] = []
    if isolate_after is not None:
        rows = client.xpending_range(stream, group, "-", "+", count, idle=min_idle_ms)
        suspects = [_s(r["message_id"]) for r in rows if r["times_delivered"] >= isolate_after]
        if suspects:
            normal = [_s(r["message_id"]) for r in rows if r["times_delivered"] < isolate_after]
            ids = normal + suspects[:1] if take_suspect else normal
            if waiting is not None:
                waiting.extend(suspects[1:] if take_suspect else suspects)
            claimed, deleted = _claim_ids(client, stream, group, consumer, min_idle_ms, ids)
            _set_delivery_counts(client, stream, group, claimed)
            return claimed, deleted
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
        # XPENDING ... IDLE (Redis >= 6.2) lists only entries idle long enough, so live
        # workers' older entries cannot hide a dead worker's newer ones.
        rows = client.xpending_range(stream, group, "-", "+", count, idle=min_idle_ms)
        ids = [_s(r["message_id"]) for r in rows if r["time_since_delivered"] >= min_idle_ms]
        claimed, deleted = _claim_ids(client, stream, group, consumer, min_idle_ms, ids)
    _set_delivery_counts(client, stream, group, claimed)
    return claimed, deleted


def _claim_ids(
    client: Any, stream: str, group: str, consumer: str, min_idle_ms: int, ids: list[str]
) -> tuple[list[Entry], list[str]]:
    """``XCLAIM`` ``ids`` (still idle ``min_idle_ms``); ids deleted from the stream meanwhile
    are acked away and returned second."""
    claimed: list[Entry] = []
    if not ids:
        return claimed, []
    for entry_id, fields in client.xclaim(stream, group, consumer, min_idle_ms, ids):
        if entry_id is not None and fields is not None:
            claimed.append(_entry(stream, entry_id, fields))
    got = {e.id for e in claimed}
    deleted = [i for i in ids if i not in got and not client.xrange(stream, i, i)]
    if deleted:
        client.xack(stream, group, *deleted)
    return claimed, deleted


def _set_delivery_counts(client: Any, stream: str, group: str, claimed: list[Entry]) -> None:
    if claimed:
        counts = delivery_counts(client, stream, group, [e.id for e in claimed])
        for e in claimed:
            e.deliveries = counts.get(e.id, e.deliveries)


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
