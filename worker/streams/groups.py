"""Consumer groups and the server they live on: what the worker asks before and after it reads.

* :func:`ensure_group` - ``XGROUP CREATE ... MKSTREAM``, tolerating only ``BUSYGROUP``;
* :func:`forget_consumer` - ``XGROUP DELCONSUMER`` when the consumer holds nothing (script
  :data:`~worker.streams.scripts.FORGET`);
* :func:`pending_count` - ``XPENDING`` (summary, or one consumer's range);
* :func:`trim_acked` - ``XINFO GROUPS`` + ``XPENDING`` + ``XTRIM MINID``: drop the entries
  every group has read and acked (without it a job stream grows forever);
* :func:`is_cluster`, :func:`server_version` (``INFO server``), :func:`supports_autoclaim`.
"""

from __future__ import annotations

from typing import Any

import redis

from worker.connections import server_version
from worker.streams.scripts import FORGET


def is_cluster(client: Any) -> bool:
    """True for a ``redis.RedisCluster`` client."""
    return isinstance(client, redis.RedisCluster)


def supports_autoclaim(version: tuple[int, int, int]) -> bool:
    """XAUTOCLAIM exists from Redis 6.2; we use it from 7.0, whose reply (3 elements, deleted
    ids removed from the PEL) redis-py parses safely. Older servers use XPENDING + XCLAIM."""
    return version >= (7, 0, 0)


def ensure_group(client: Any, stream: str, group: str, start_id: str = "0") -> bool:
    """Create ``group`` on ``stream`` (creating the stream). True if created, False if it existed.

    Only ``BUSYGROUP`` is tolerated; any other error propagates. The default ``start_id`` "0"
    means the group reads every entry already in the stream (see
    :func:`worker.streams.stats.stream_stats` for what that makes the lag of a missing group).
    """
    try:
        client.xgroup_create(stream, group, id=start_id, mkstream=True)
        return True
    except redis.ResponseError as exc:
        if str(exc).startswith("BUSYGROUP"):
            return False
        raise


def forget_consumer(client: Any, stream: str, group: str, consumer: str) -> bool:
    """Delete ``consumer`` from ``group`` if it holds no pending entry (atomic check-and-delete),
    so a fleet whose pods come and go does not pile up dead consumer names. True if deleted."""
    return int(client.eval(FORGET, 1, stream, group, consumer)) == 1


def pending_count(client: Any, stream: str, group: str, consumer: str | None = None) -> int:
    """Entries pending in ``group`` (of ``consumer`` only when given)."""
    if consumer is None:
        return int(client.xpending(stream, group)["pending"])
    rows = client.xpending_range(stream, group, "-", "+", 1000, consumername=consumer)
    return len(rows)


__all__ = [
    "ensure_group",
    "forget_consumer",
    "is_cluster",
    "pending_count",
    "server_version",
    "supports_autoclaim",
]


def _id(raw: Any) -> tuple[int, int]:
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def trim_acked(client: Any, stream: str, *, upto: str | None = None) -> int:
    """``XTRIM stream MINID ~ floor``: delete entries that every group of ``stream`` has read
    and acked; how many were deleted. ``floor`` is, over all groups, the lowest of each group's
    oldest pending id (``XPENDING``) or, when nothing is pending, its last delivered id + 1
    (``XINFO GROUPS``): an unread or pending entry is never touched. A stream without a group
    is left alone. ``~`` lets Redis trim whole macro nodes only (cheap; a few acked entries
    stay until the next trim).

    ``upto`` (an entry id) caps the floor at ``upto`` + 1: a worker passes the newest entry it
    acked itself, because a group's last delivered id also moves without any delivery (a group
    created at ``$`` over entries that ``XGROUP SETID ... 0`` replays later; they are neither
    pending nor read)."""
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:  # no such key
        return 0
    floor: tuple[int, int] | None = None
    for g in groups:
        summary = client.xpending(stream, g["name"])
        if summary["pending"]:
            candidate = _id(summary["min"])
        else:
            ms, seq = _id(g["last-delivered-id"])
            candidate = (ms, seq + 1)
        floor = candidate if floor is None else min(floor, candidate)
    if floor is not None and upto is not None:
        ms, seq = _id(upto)
        floor = min(floor, (ms, seq + 1))
    if floor is None or floor <= (0, 1):
        return 0
    return int(client.xtrim(stream, minid=f"{floor[0]}-{floor[1]}", approximate=True))
