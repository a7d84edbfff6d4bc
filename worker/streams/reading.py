"""Reading job entries: ``XREADGROUP`` over one or more partition streams, and the
:class:`Entry` every other streams function takes or returns.

* :func:`read_new` - ``XREADGROUP ... >`` over the streams, fair over partitions, no CROSSSLOT
  on Cluster (one stream per command there);
* :func:`entry_from_fields` - an :class:`Entry` from one reply row (RESP2 or RESP3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from worker.protocol import PAYLOAD_FIELD
from worker.streams.groups import is_cluster


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


def as_text(value: Any) -> str:
    """A reply value as ``str`` (clients run with ``decode_responses`` off: most are bytes;
    bytes that are not UTF-8, say a consumer name, read with replacement characters)."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def entry_from_fields(stream: str, entry_id: Any, fields: Any, deliveries: int = 1) -> Entry:
    """The :class:`Entry` of one ``(id, fields)`` reply row (``payload`` None when absent)."""
    payload = None
    if isinstance(fields, dict):
        payload = fields.get(PAYLOAD_FIELD, fields.get(PAYLOAD_FIELD.decode()))
        if isinstance(payload, str):
            payload = payload.encode()
    return Entry(stream=stream, id=as_text(entry_id), payload=payload, deliveries=deliveries)


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
        name = as_text(stream)
        for entry_id, fields in entries or []:
            out.append(entry_from_fields(name, entry_id, fields))
    return out


__all__ = ["Entry", "as_text", "entry_from_fields", "read_new"]
