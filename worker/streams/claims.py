"""Leases and reclaim: keeping the entries this consumer works on, taking those of dead ones.

* :func:`renew_leases` - ``XCLAIM ... JUSTID`` of entries this consumer still owns (script
  :data:`~worker.streams.scripts.RENEW`: the ownership check and the claim in one step);
* :func:`reclaim_idle` - ``XAUTOCLAIM`` (Redis >= 7 / Valkey) or ``XPENDING ... IDLE`` +
  ``XCLAIM``; suspects (entries whose batch never finished) one at a time;
* :func:`delivery_counts` - ``XPENDING`` range: how often each entry was delivered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker.streams.reading import Entry, as_text, entry_from_fields
from worker.streams.scripts import RENEW


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
    renewed = client.eval(RENEW, 1, stream, group, consumer, *entry_ids)
    return [as_text(i) for i in renewed or []]


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
        suspects = [as_text(r["message_id"]) for r in rows if r["times_delivered"] >= isolate_after]
        if suspects:
            normal = [
                as_text(r["message_id"]) for r in rows if r["times_delivered"] < isolate_after
            ]
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
            start = as_text(reply[0])
            for entry_id, fields in reply[1]:
                if entry_id is None:
                    continue
                claimed.append(entry_from_fields(stream, entry_id, fields))
            if len(reply) > 2:
                deleted.extend(as_text(i) for i in reply[2] or [])
            if start == "0-0":
                break
    else:
        # XPENDING ... IDLE (Redis >= 6.2) lists only entries idle long enough, so live
        # workers' older entries cannot hide a dead worker's newer ones.
        rows = client.xpending_range(stream, group, "-", "+", count, idle=min_idle_ms)
        ids = [as_text(r["message_id"]) for r in rows if r["time_since_delivered"] >= min_idle_ms]
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
            claimed.append(entry_from_fields(stream, entry_id, fields))
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
        as_text(r["message_id"]): int(r["times_delivered"])
        for r in rows
        if as_text(r["message_id"]) in wanted
    }


__all__ = ["delivery_counts", "reclaim_idle", "renew_leases"]
