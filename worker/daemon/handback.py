"""Hand-back on drain: what a stopping worker gives back, and how the others notice.

A worker asked to stop finishes only the batch that computes; every job it read but did not start
(the backlog and the batch queued behind the computing one) is handed back to the group with
:func:`give_back` (``streams.hand_back``: the entries look idle far past ``claim_idle_ms`` and the
delivery that never ran is taken back from their count). :class:`HandBackWatch` runs in every
serving worker: every :data:`POLL_S` it reads the hand-back counters of its streams and, when one
moved, tells the loop to reclaim now, so handed-back jobs wait neither for ``claim_idle_ms`` nor
for the next periodic reclaim. After that reclaim, givers that hold nothing any more are deleted
from the group (drained pods do not pile up as consumers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from worker import streams
from worker.daemon.backlog import Backlog
from worker.daemon.config import WorkerConfig
from worker.daemon.context import Pending
from worker.daemon.leases import InFlight
from worker.daemon.pipeline import BatchPipeline
from worker.observability.metrics import WorkerMetrics

log = logging.getLogger(__name__)

#: How often a serving worker reads the hand-back counters (one ``HGETALL`` per stream).
POLL_S = 0.25


def give_back(
    client: Any, pendings: Sequence[Pending], *, group: str, consumer: str, in_flight: InFlight
) -> int:
    """Hand ``pendings`` (read, never started) back to ``group``; how many were handed back.

    They leave the in-flight set first, and the hand-back waits for a lease renewal under way
    (``InFlight.renewal``), so no renewal resets their idle time afterwards. On an error they
    are held again (the caller keeps them and drains them itself) and the error is raised.
    """
    by_stream: dict[str, list[str]] = {}
    for p in pendings:
        by_stream.setdefault(p.entry.stream, []).append(p.entry.id)
        in_flight.discard(p.entry.stream, p.entry.id)
    handed = 0
    done: set[str] = set()
    try:
        with in_flight.renewal:
            for stream, ids in by_stream.items():
                handed += len(streams.hand_back(client, stream, group, consumer, ids))
                done.add(stream)
    except BaseException:
        for stream, ids in by_stream.items():
            if stream not in done:
                for entry_id in ids:
                    in_flight.add(stream, entry_id)
        raise
    if handed < len(pendings):
        log.warning(
            "%d of %d entries to hand back were already taken over by another consumer",
            len(pendings) - handed,
            len(pendings),
        )
    return handed


class HandBackWatch:
    """Says when another worker handed entries back on this worker's streams."""

    def __init__(
        self, job_streams: Sequence[str], *, group: str, consumer: str, poll_s: float = POLL_S
    ) -> None:
        self._streams = list(job_streams)
        self._group = group
        self._consumer = consumer
        self.poll_s = poll_s
        self._last = float("-inf")
        self._seen: dict[str, dict[str, int]] = {}
        self._givers: dict[str, list[str]] = {}  # stream -> givers to forget after the reclaim
        self.looks = 0  # how often the counters were read

    def due(self, client: Any, now: float | None = None) -> bool:
        """True when a counter moved since the last look (read at most every ``poll_s``); on the
        first look, when any counter exists (a hand-back may have come between this worker's
        reclaim at start and this look; one reclaim too many costs one ``XAUTOCLAIM``)."""
        now = time.monotonic() if now is None else now
        if now - self._last < self.poll_s:
            return False
        self._last = now
        self.looks += 1
        moved = False
        for stream, marks in streams.handback_marks(client, self._streams).items():
            before = self._seen.get(stream, {})
            if any(before.get(k) != v for k, v in marks.items()):
                moved = True
            self._seen[stream] = marks
            givers = [g for g in marks if g != self._consumer]
            if givers:
                self._givers[stream] = givers
        return moved

    def forget_givers(self, client: Any) -> None:
        """After a reclaim: delete the givers that hold nothing any more from the group."""
        givers, self._givers = self._givers, {}
        for stream, names in givers.items():
            gone = streams.forget_givers(client, stream, self._group, names)
            if gone:
                log.info("forgot %d drained consumers of %s: %s", len(gone), stream, ",".join(gone))


class HandBack:
    """Both sides of the hand-back in one worker; with ``config.handback`` False neither runs
    (``--no-handback``: the whole backlog is drained, other workers' hand-backs are not watched)."""

    def __init__(self, config: WorkerConfig, in_flight: InFlight, metrics: WorkerMetrics) -> None:
        self.enabled = config.handback
        self._group, self._consumer = config.group, config.consumer
        self._in_flight = in_flight
        self._metrics = metrics
        self.watch = HandBackWatch(config.streams, group=config.group, consumer=config.consumer)
        self.given = 0  # jobs this worker handed back
        self._failed = False

    def give(
        self, client: Any, pipeline: BatchPipeline, backlog: Backlog, *, stopping: bool
    ) -> None:
        """When ``stopping`` (draining): hand every job read but not started (the batch queued
        behind the computing one, the backlog) back to the group; only the computing batch is
        left to finish. A hand-back that fails (Redis away) keeps the jobs in the backlog, and
        the worker drains them itself, as with ``--no-handback``."""
        if not (stopping and self.enabled) or self._failed:
            return
        pendings = pipeline.take_queued() + backlog.take_all()
        if not pendings:
            return
        try:
            handed = give_back(
                client,
                pendings,
                group=self._group,
                consumer=self._consumer,
                in_flight=self._in_flight,
            )
        except Exception as exc:  # finish them here rather than leave them idle
            backlog.put_front(pendings)
            self._failed = True
            log.warning("hand-back of %d jobs failed (%s); draining them here", len(pendings), exc)
            return
        self.given += handed
        self._metrics.handed_back.inc(handed)
        log.info("handed back %d jobs read but not started (draining)", handed)

    def due(self, client: Any) -> bool:
        """True when another worker handed entries back: reclaim now (``HandBackWatch.due``)."""
        return self.enabled and self.watch.due(client)

    def after_reclaim(self, client: Any) -> None:
        """Forget the givers that hold nothing any more (``HandBackWatch.forget_givers``)."""
        if self.enabled:
            self.watch.forget_givers(client)


__all__ = ["POLL_S", "HandBack", "HandBackWatch", "give_back"]
