"""In-flight entry registry and the lease keeper thread.

The lease keeper renews this consumer's in-flight entries (``XCLAIM ... JUSTID``) every
``claim_idle_ms / 3`` on its own Redis connection. It never takes a lock that the model holds and
never waits on the executor, so a batch that runs for minutes keeps its entries even when
``claim_idle_ms`` is a few seconds (the starved-heartbeat failure of dramatiq #692).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from worker import connections, streams
from worker.connections import CONNECT_ERRORS
from worker.observability.health import HealthState
from worker.observability.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class InFlight:
    """Thread-safe set of ``(stream, entry_id)`` this worker holds (read, not yet acked)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: held by the lease keeper through one renewal round (its snapshot and its renewals),
        #: so a hand-back after ``discard`` is never followed by a renewal of a stale snapshot
        self.renewal = threading.Lock()
        self._ids: dict[str, set[str]] = {}
        # per stream, the newest entry (ms, seq) this worker answered and acked
        self._done: dict[str, tuple[int, int]] = {}

    def add(self, stream: str, entry_id: str) -> None:
        """Register an entry as held."""
        with self._lock:
            self._ids.setdefault(stream, set()).add(entry_id)

    def discard(self, stream: str, entry_id: str) -> None:
        """Forget an entry (after it was acked or dead-lettered)."""
        with self._lock:
            ids = self._ids.get(stream)
            if ids is not None:
                ids.discard(entry_id)
                if not ids:
                    del self._ids[stream]

    def done(self, stream: str, entry_id: str) -> None:
        """Forget an entry this worker answered and acked (or dead-lettered): it counts towards
        :meth:`done_upto`."""
        self.discard(stream, entry_id)
        ms, _, seq = entry_id.partition("-")
        key = (int(ms), int(seq or 0))
        with self._lock:
            if key > self._done.get(stream, (-1, -1)):
                self._done[stream] = key

    def done_upto(self, stream: str) -> str | None:
        """The newest entry id of ``stream`` this worker acked (None: none yet); the stats
        sampler trims no further (``streams.trim_acked(upto=...)``)."""
        with self._lock:
            key = self._done.get(stream)
        return None if key is None else f"{key[0]}-{key[1]}"

    def held(self, stream: str, ids: set[str]) -> set[str]:
        """The subset of ``ids`` still held on ``stream``."""
        with self._lock:
            return ids & self._ids.get(stream, set())

    def release_all_but(self, keep: set[tuple[str, str]]) -> int:
        """Forget every held entry whose ``(stream, entry_id)`` is not in ``keep``; how many."""
        released = 0
        with self._lock:
            for stream in list(self._ids):
                ids = self._ids[stream]
                gone = {i for i in ids if (stream, i) not in keep}
                ids -= gone
                released += len(gone)
                if not ids:
                    del self._ids[stream]
        return released

    def snapshot(self) -> dict[str, list[str]]:
        """A copy of the held ids per stream."""
        with self._lock:
            return {s: sorted(ids) for s, ids in self._ids.items()}

    def __len__(self) -> int:
        with self._lock:
            return sum(len(ids) for ids in self._ids.values())


class LeaseKeeper:
    """A daemon thread renewing the leases of every in-flight entry every ``interval_s``."""

    def __init__(
        self,
        client_factory: Callable[[], Any],
        in_flight: InFlight,
        *,
        group: str,
        consumer: str,
        interval_s: float,
        metrics: WorkerMetrics,
        health: HealthState,
        busy: Callable[[], bool] | None = None,
    ) -> None:
        self._factory = client_factory
        self._in_flight = in_flight
        self._group = group
        self._consumer = consumer
        self._interval_s = interval_s
        self._metrics = metrics
        self._health = health
        self._busy = busy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._client: Any = None

    def start(self) -> LeaseKeeper:
        """Start the thread; returns self."""
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        """Ask the thread to stop and wait a little for it."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _drop_client(self) -> None:
        """Close the client (its sockets) and forget it; the next renewal connects afresh."""
        client, self._client = self._client, None
        if client is not None:
            connections.remember(client)  # a fresh cluster client tries the nodes it knew
            with contextlib.suppress(Exception):
                client.close()

    def renew_once(self) -> int:
        """Renew every held entry now; returns how many were renewed."""
        if self._client is None:
            self._client = self._factory()
        total = 0
        with self._in_flight.renewal:
            for stream, ids in self._in_flight.snapshot().items():
                renewed = streams.renew_leases(
                    self._client, stream, self._group, self._consumer, ids
                )
                total += len(renewed)
                # Entries acked since the snapshot are not pending any more: not lost, just done.
                lost = self._in_flight.held(stream, set(ids) - set(renewed))
                if lost:
                    log.warning("%d in-flight entries of %s are no longer ours", len(lost), stream)
        if total:
            self._metrics.leases_renewed.inc(total)
        return total

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.renew_once()
                self._health.beat("lease")
                if self._busy is not None and self._busy():
                    self._health.busy_beat("loop")  # the main thread is inside a batch
            except CONNECT_ERRORS as exc:  # an outage, a failover: never fatal
                log.warning("lease renewal failed (Redis unreachable): %s", exc)
                self._drop_client()  # a fresh connection next time
            except Exception:  # never let the lease thread die
                log.exception("lease renewal failed")
                self._metrics.loop_errors.labels(where="lease").inc()
