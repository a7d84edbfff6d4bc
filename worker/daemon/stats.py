"""Stream statistics sampled into the worker's gauges (so no extra exporter is needed).

Every ``stats_interval_s`` the worker publishes, per job stream, its length, the group's lag,
pending count and consumers, and the length of its dead-letter stream (and per queue the lag
summed over its partitions), from
:func:`worker.streams.stream_stats` (the same numbers ``scoring-worker info`` shows); trims
the entries every group has acked (:func:`worker.streams.trim_acked`); and writes the worker's
heartbeat (``worker.daemon.heartbeat``: what it serves and holds).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from worker import streams
from worker.daemon.heartbeat import Heartbeat
from worker.observability.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class StatsSampler:
    """Samples the stream gauges at most every ``interval_s``."""

    def __init__(
        self,
        streams_: tuple[str, ...],
        group: str,
        *,
        metrics: WorkerMetrics,
        dead_stream_of: Callable[[str], str],
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        heartbeat: Heartbeat | None = None,
        acked_upto: Callable[[str], str | None] | None = None,
        queue_of: Callable[[str], str] | None = None,
    ) -> None:
        self.streams = streams_
        self.group = group
        self.interval_s = interval_s
        self._metrics = metrics
        self._dead_stream_of = dead_stream_of
        self._clock = clock
        self._heartbeat = heartbeat
        # the newest entry this worker acked per stream (None: trim nothing yet); None: no cap
        self._acked_upto = acked_upto
        self._last: float | None = None
        self._queue_of = queue_of  # a stream's queue: scoring_queue_lag sums its partitions

    def maybe_sample(self, client: Any) -> bool:
        """Sample when ``interval_s`` has passed since the last time; True when it did."""
        now = self._clock()
        if self._last is not None and now - self._last < self.interval_s:
            return False
        self._last = now
        self.sample(client)
        return True

    def sample(self, client: Any) -> None:
        """Publish every stream's gauges (a stream whose stats fail for good is skipped), then
        the worker's heartbeat (a refused heartbeat is logged and counted, never fatal)."""
        self._sample_streams(client)
        if self._heartbeat is None:
            return
        try:
            self._heartbeat.beat(client)
        except redis.ResponseError as exc:  # e.g. NOPERM of an older ACL: keep serving
            if streams.is_transient(exc):
                raise
            log.warning("heartbeat not written: %s", exc)
            self._metrics.loop_errors.labels(where="heartbeat").inc()

    def _sample_streams(self, client: Any) -> None:
        m, group = self._metrics, self.group
        lags: dict[str, int | None] = {}  # per queue; None: a partition cannot say
        for stream in self.streams:
            dead = self._dead_stream_of(stream)
            try:
                st = streams.stream_stats(client, stream, group)
                dead_len = int(client.xlen(dead))
            except redis.ResponseError as exc:  # e.g. a key of the wrong type: skip, keep serving
                if streams.is_transient(exc) or streams.is_nogroup(exc):
                    raise
                log.warning("stream stats of %s unavailable: %s", stream, exc)
                m.loop_errors.labels(where="stats").inc()
                continue
            m.stream_length.labels(stream=stream).set(st["length"])
            if st["lag"] is not None:
                m.stream_lag.labels(stream=stream, group=group).set(st["lag"])
            else:  # unknown (Redis < 7 after reads, or trimmed): no series beats a stale one
                with contextlib.suppress(KeyError):
                    m.stream_lag.remove(stream, group)
            if self._queue_of is not None:
                queue, lag = self._queue_of(stream), st["lag"]
                before = lags.get(queue, 0)
                lags[queue] = None if lag is None or before is None else before + int(lag)
            m.stream_pending.labels(stream=stream, group=group).set(st["pending"])
            m.stream_consumers.labels(stream=stream, group=group).set(st["consumers"])
            m.dead_letter_length.labels(stream=dead).set(dead_len)
            upto = self._acked_upto(stream) if self._acked_upto is not None else None
            if self._acked_upto is not None and upto is None:
                continue  # this worker acked nothing there yet: nothing it may trim
            try:  # scored entries leave the stream: a long-running queue stays bounded
                streams.trim_acked(client, stream, upto=upto)
            except redis.ResponseError as exc:  # e.g. XTRIM MINID before Redis 6.2
                if streams.is_transient(exc):
                    raise
                log.debug("trim of %s skipped: %s", stream, exc)
        for queue, total in lags.items():
            if total is not None:
                m.queue_lag.labels(queue=queue, group=group).set(total)
            else:
                with contextlib.suppress(KeyError):
                    m.queue_lag.remove(queue, group)
