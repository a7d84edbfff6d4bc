"""Reading entries: new ones for the group (``XREADGROUP``), idle ones of dead consumers
(``XAUTOCLAIM``, or ``XPENDING`` + ``XCLAIM`` before Redis 6.2), and whether all are done.

Every entry read is registered in the in-flight set at once, so the lease keeper renews it from
then on. Suspects (entries whose batch never finished) are claimed one at a time over all
partitions, the next as soon as the previous one is done.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from worker import streams
from worker.daemon.config import WorkerConfig
from worker.daemon.leases import InFlight
from worker.observability.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class EntryReader:
    """Reads and reclaims the entries of one consumer on its job streams (of every queue)."""

    def __init__(self, config: WorkerConfig, in_flight: InFlight, metrics: WorkerMetrics) -> None:
        self.config = config
        self._in_flight = in_flight
        self._metrics = metrics
        self.use_autoclaim = True  # set from the server version on (re)connect
        self._rotation = 0
        self._last_reclaim = 0.0
        self._suspects_waiting = False

    def read(self, client: Any, rooms: dict[str, int], block_ms: int) -> list[streams.Entry]:
        """New entries from the streams of each queue with room (``rooms``: queue -> about that
        many entries over its streams, split evenly, rounded up), partitions in rotating order
        (``block_ms`` 0: no BLOCK).
        One ``XREADGROUP`` when every queue read has the same room (always for one queue);
        otherwise one non-blocking read per queue, so each gets exactly its own COUNT."""
        cfg = self.config
        wanted = {q.name: q.streams for q in cfg.shares if rooms.get(q.name, 0) > 0}
        if not wanted:
            return []
        self._rotation += 1
        # XREADGROUP's COUNT is per stream: a queue's room is split over its partitions, so a
        # read takes about ``room`` entries in all, not ``room`` from each partition
        per_stream = {name: -(-rooms[name] // len(ss)) for name, ss in wanted.items()}
        counts = set(per_stream.values())
        reads = (
            [([s for ss in wanted.values() for s in ss], counts.pop(), block_ms)]
            if len(counts) == 1
            else [(list(ss), per_stream[name], 0) for name, ss in wanted.items()]
        )
        entries: list[streams.Entry] = []
        for keys_, count, block in reads:
            entries += streams.read_new(
                client,
                keys_,
                cfg.group,
                cfg.consumer,
                count=count,
                block_ms=block,
                rotation=self._rotation,
            )
        for e in entries:
            self._in_flight.add(e.stream, e.id)
        return entries

    def reclaim_due(self, *, suspect_held: bool, now: float | None = None) -> bool:
        """True when idle entries should be looked for now (and the interval restarts)."""
        now = time.monotonic() if now is None else now
        suspects_next = self._suspects_waiting and not suspect_held
        if suspects_next or now - self._last_reclaim >= self.config.reclaim_every_s:
            self._last_reclaim = now
            return True
        return False

    def reclaim(self, client: Any, *, suspect_held: bool) -> list[streams.Entry]:
        """Claim entries idle past ``claim_idle_ms``: one suspect at most, none if one is held."""
        cfg = self.config
        held = self._in_flight.snapshot()
        out: list[streams.Entry] = []
        waiting: list[str] = []
        take_suspect = not suspect_held
        for stream in cfg.streams:
            claimed, deleted = streams.reclaim_idle(
                client,
                stream,
                cfg.group,
                cfg.consumer,
                min_idle_ms=cfg.claim_idle_ms,
                count=cfg.read_count,
                use_autoclaim=self.use_autoclaim,
                isolate_after=cfg.isolate_after_deliveries,
                take_suspect=take_suspect,
                waiting=waiting,
            )
            if any(e.deliveries > cfg.isolate_after_deliveries for e in claimed):
                take_suspect = False  # one suspect at a time, over all partitions
            if deleted:
                log.warning(
                    "%d pending entries of %s were deleted before reclaim", len(deleted), stream
                )
            mine = set(held.get(stream, ()))
            for e in claimed:
                if e.id in mine:
                    continue  # our own entry whose lease lapsed; it is already held
                self._in_flight.add(e.stream, e.id)
                out.append(e)
        if out:
            self._metrics.reclaimed.inc(len(out))
            log.info("reclaimed %d idle entries", len(out))
        self._suspects_waiting = bool(waiting)
        return out

    def drained(self, client: Any) -> bool:
        """True when nothing is pending for this consumer on any of its streams."""
        cfg = self.config
        return all(
            streams.pending_count(client, s, cfg.group, cfg.consumer) == 0 for s in cfg.streams
        )
