"""Stream statistics: the one function that reads a stream's length, lag, pending and consumers.

:func:`stream_stats` (``XLEN``, ``XINFO GROUPS``, ``XINFO CONSUMERS``) feeds the worker's stream
gauges and ``scoring-worker info`` (:func:`worker.streams.admin.stream_info` adds the oldest
pending age and the dead-letter depth to it), so the two never disagree.

What ``lag`` means (entries the group has not been delivered yet):

* group present: ``XINFO GROUPS`` lag (Redis >= 7); on Redis < 7, which has no lag field, the
  stream length while the group has read nothing (last-delivered id ``0-0``), else ``None``;
  ``None`` too on Redis 7 when entries were deleted from the middle of the stream (Redis
  cannot tell);
* group missing (not created yet, or lost with a flush): the stream length. Workers create their
  group at id ``0`` (:func:`worker.streams.ensure_group`), so every entry now in the stream
  will be delivered to them: all of it is lag. This is what an autoscaler needs to start the
  first worker of an idle queue;
* stream missing: 0 (an absent stream is an empty one to Redis: ``XLEN`` is 0).
"""

from __future__ import annotations

from typing import Any

import redis

from worker.streams.reading import as_text


def _group_lag(group_row: dict[Any, Any], length: int) -> int | None:
    lag = group_row.get("lag")
    if lag is not None:
        return int(lag)
    if as_text(group_row.get("last-delivered-id", "")) in ("0-0", "0"):
        return length  # nothing read yet (Redis < 7 has no lag field)
    return None


def _inactive_ms(consumer_row: dict[Any, Any]) -> int | None:
    """ms since the consumer's last successful read or claim (Redis >= 7.2; else None)."""
    raw = consumer_row.get("inactive")
    return None if raw is None or int(raw) == -1 else int(raw)


def stream_stats(client: Any, stream: str, group: str) -> dict[str, Any]:
    """Length, group lag/pending/consumers and per-consumer pending/idle of one stream.

    Returns ``{"stream", "group", "length", "exists", "group_exists", "lag", "pending",
    "consumers", "last_delivered_id", "consumer_details": [{name, pending, idle_ms,
    inactive_ms}]}``. ``lag`` is explained in this module's docstring: the stream length when
    the group is missing, ``None`` when the server cannot say (Redis < 7 after the group's first
    read, or a stream with entries deleted from its middle).

    A key of another type raises ``redis.ResponseError`` (``WRONGTYPE``).
    """
    length = int(client.xlen(stream))
    out: dict[str, Any] = {
        "stream": stream,
        "group": group,
        "length": length,
        "exists": False,
        "group_exists": False,
        "lag": length,  # no group (or no stream): every entry is waiting to be read
        "pending": 0,
        "consumers": 0,
        "last_delivered_id": None,
        "consumer_details": [],
    }
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError as exc:
        if "no such key" not in str(exc).lower():
            raise
        return out
    out["exists"] = True
    row = next((g for g in groups if as_text(g.get("name")) == group), None)
    if row is None:
        return out
    out["group_exists"] = True
    out["pending"] = int(row.get("pending") or 0)
    out["consumers"] = int(row.get("consumers") or 0)
    out["lag"] = _group_lag(row, length)
    out["last_delivered_id"] = as_text(row.get("last-delivered-id", ""))
    out["consumer_details"] = [
        {
            "name": as_text(c.get("name")),
            "pending": int(c.get("pending") or 0),
            "idle_ms": int(c.get("idle") or 0),
            "inactive_ms": _inactive_ms(c),
        }
        for c in client.xinfo_consumers(stream, group)
    ]
    return out


__all__ = ["stream_stats"]
