"""The worker: one loop in the main thread that reads, batches and writes; a compute stage scores.

Each step: sample the stream gauges when due, reclaim idle entries when due, read new entries
(blocking only when nothing is held), fill the batch up to the token budget within
``max_wait_ms``, answer what cannot be scored, hand one batch to the compute stage
(:mod:`worker.daemon.pipeline`), write results and ack. Pipelined (the default), the forward runs
on the compute thread while the main thread reads, decodes and validates the next batch (at most
one batch's token budget ahead; nothing while a suspect runs alone) and writes and acks the
previous one; with ``pipeline=False`` the batch runs inline, between the reads and the writes.
Around it:
a lease thread (:mod:`worker.daemon.leases`) keeps held entries owned while a batch runs, drain
control (:mod:`worker.daemon.drain`) handles SIGTERM/SIGINT, and the loop reconnects when Redis
goes away (:mod:`worker.daemon.link`). The roles live in their own modules; this class wires them
together and owns the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from worker import streams
from worker.config import RedisSettings
from worker.connections import connect
from worker.daemon.backlog import Backlog, batch_share
from worker.daemon.config import WorkerConfig
from worker.daemon.context import JobContext, Outbox, Pending
from worker.daemon.drain import DrainControl, SignalWatcher
from worker.daemon.handback import HandBack
from worker.daemon.heartbeat import Heartbeat, heartbeat_ttl_s
from worker.daemon.intake import prepare_entry
from worker.daemon.jobs import score_batch
from worker.daemon.leases import InFlight, LeaseKeeper
from worker.daemon.link import REDIS_DOWN, RedisLink
from worker.daemon.pipeline import BatchPipeline
from worker.daemon.reader import EntryReader
from worker.daemon.server_check import ServerCheck
from worker.daemon.stats import StatsSampler
from worker.daemon.writer import OutboxWriter
from worker.observability.health import HealthServer, HealthState
from worker.observability.metrics import WorkerMetrics
from worker.observability.startup import StartupClock
from worker.scorer import FallbackEvent, Scorer

log = logging.getLogger(__name__)
#: How long the main thread waits for a computing batch before it looks at Redis again: from
#: ``POLL_MIN_S``, doubling while nothing new comes in, up to ``POLL_MAX_S`` (a finished batch
#: ends the wait at once). Each look is a Redis round trip and a wake-up that takes a core from
#: the forward's threads (measured on SmolLM2, 2 cores: polling every 32 ms through a 23 s batch
#: cost 0.5 s of main-thread CPU and made the forward 9% slower than in-process); new jobs only
#: wait for the next batch anyway, which a finished batch starts at once.
POLL_MIN_S = 0.002
POLL_MAX_S = 0.25


class Worker:
    """A consumer of one or more job streams in one consumer group, driving a ``Scorer``."""

    def __init__(
        self,
        config: WorkerConfig,
        redis_settings: RedisSettings,
        scorer: Scorer,
        *,
        metrics: WorkerMetrics | None = None,
        health: HealthState | None = None,
        client_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.config = config
        self.startup = StartupClock()  # serve sets the one it timed; published at ready
        self.redis_settings = redis_settings
        self.scorer = scorer
        self.metrics = metrics or WorkerMetrics()
        self.health = health or HealthState()
        self.metrics.bind_health(self.health)  # ready/model_loaded read health at scrape
        self.in_flight = InFlight()
        self.jobs = JobContext(config, scorer, self.metrics, self.in_flight)
        self.backlog = Backlog(
            max_batch_tokens=config.max_batch_tokens,
            isolate_after_deliveries=config.isolate_after_deliveries,
            shares=config.shares,  # one lane per queue, sharing the batches by weight
        )
        self.drain = DrainControl(config.drain_timeout_s, health=self.health,
                                  metrics=self.metrics, held=self.in_flight.__len__)  # fmt: skip
        self.signals = SignalWatcher(self.drain.request_stop)
        factory = client_factory or (lambda: connect(redis_settings))
        self.link = RedisLink(factory, config, health=self.health, metrics=self.metrics,
                              wait=self.drain.wait)  # fmt: skip
        self.reader = EntryReader(config, self.in_flight, self.metrics)
        self.handback = HandBack(config, self.in_flight, self.metrics)  # drain: give back
        self.writer = OutboxWriter(self.jobs)
        heartbeat = Heartbeat(config.streams, group=config.group, consumer=config.consumer,
                              scorer=scorer, ttl_s=heartbeat_ttl_s(config.stats_interval_s),
                              weights={q.name: q.weight for q in config.shares},
                              eviction_allowed=config.allow_redis_eviction)  # fmt: skip
        self.stats = StatsSampler(config.streams, config.group, metrics=self.metrics,
                                  dead_stream_of=self.jobs.dead_stream_of,
                                  interval_s=config.stats_interval_s,
                                  heartbeat=heartbeat,
                                  acked_upto=self.in_flight.done_upto,
                                  queue_of=config.queue_of)  # fmt: skip
        self.server = ServerCheck(config, metrics=self.metrics, health=self.health)
        self.jobs_done = 0
        self.pipeline = BatchPipeline(partial(score_batch, self.jobs), threaded=config.pipeline)
        self._poll_s = POLL_MIN_S
        self.metrics.set_queue_weights({q.name: q.weight for q in config.shares})
        self.http: HealthServer | None = None
        scorer.add_fallback_listener(self._on_fallback)

    # ----------------------------------------------------------------- lifecycle
    @property
    def client(self) -> Any:
        """The loop's Redis client (None before the first connect)."""
        return self.link.client

    def request_stop(self, reason: str = "requested") -> None:
        """Stop reading, finish what is held, exit the loop (readiness goes false at once)."""
        self.drain.request_stop(reason)

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT drain; a second one exits at once (main thread only)."""
        self.signals.install()

    @property
    def batch_started_s(self) -> float | None:
        """Monotonic start of the batch computing now (None when none is)."""
        return self.pipeline.started_s

    def busy(self) -> bool:
        """True while a batch computes and has run less than ``batch_timeout_s``: the lease thread
        then beats ``loop`` for the main thread, so a long batch is not mistaken for a wedged loop
        (a batch stuck past the limit still is)."""
        started = self.batch_started_s
        return started is not None and time.monotonic() - started < self.config.batch_timeout_s

    def run(self) -> int:
        """Serve until stopped (signal, ``--burst`` drained, ``--max-jobs`` reached); returns 0."""
        with self.drain.serving():
            return self._serve()

    def _on_fallback(self, event: FallbackEvent) -> None:
        self.metrics.record_fallback(event.requested, event.used, event.reason)
        self.metrics.set_backend(event.used)

    def _start_serving(self) -> None:
        """Open the HTTP endpoint (unless ``serve`` did) and publish the scorer's state."""
        cfg = self.config
        if cfg.metrics_port is not None and self.http is None:
            self.http = HealthServer(
                self.metrics.registry, self.health, host=cfg.metrics_host, port=cfg.metrics_port
            ).start()  # logs "metrics on http://HOST:PORT/metrics", once
        self.metrics.up.set(1)
        self.health.model_ready = True
        self.metrics.set_backend(str(self.scorer.info.get("attention_backend") or "none"))
        for event in self.jobs.load_fallbacks():
            self.metrics.record_fallback(event.requested, event.used, event.reason)

    def _serve(self) -> int:
        cfg = self.config
        self._start_serving()
        while not self._connect():
            if self.drain.stopping:
                return 0
        leases = LeaseKeeper(
            self.link.factory, self.in_flight, group=cfg.group, consumer=cfg.consumer,
            interval_s=cfg.lease_interval_s, metrics=self.metrics, health=self.health,
            busy=self.busy,
        ).start()  # fmt: skip
        self.health.started = True
        self.startup.ready(self.metrics)  # the start-up phases (the last: connect): published
        log.info("worker %s serving %s (group %s) on %s", cfg.consumer, ",".join(cfg.streams),
                 cfg.group, self.redis_settings.redacted_url)  # fmt: skip
        try:
            self._loop()
            self.link.forget_consumer()
        finally:
            leases.stop()
            self.pipeline.close()
            self.metrics.up.set(0)
            self.metrics.in_flight.set(0)
            self.health.started = False
        log.info("worker %s stopped after %d jobs", cfg.consumer, self.jobs_done)
        return 0

    def _loop(self) -> None:
        """Run steps until one says to exit, or a stop was asked and nothing is held."""
        while not (self.drain.stopping and not self.backlog and not self.pipeline.busy):
            try:
                if self._step():
                    return
                self.link.ok()
            except REDIS_DOWN as exc:
                self._release_orphans()
                self.link.down(exc)
            except Exception as exc:  # the one broad except: log, count, keep serving
                self._release_orphans()
                if streams.is_transient(exc):  # OOM, READONLY after a failover, ...
                    self.link.down(exc)
                elif streams.is_nogroup(exc):
                    log.warning("group or stream gone (%s); recreating", exc)
                    self.link.ensure_groups()
                else:
                    log.exception("worker loop error")
                    self.metrics.loop_errors.labels(where="loop").inc()
                    time.sleep(0.1)

    def _connect(self) -> bool:
        version = self.link.connect()
        if version is None:
            return False
        self.server.first(self.link.client)  # a policy that evicts: ConfigError, unless allowed
        self.reader.use_autoclaim = streams.supports_autoclaim(version)
        log.info("redis %s, XAUTOCLAIM %s", ".".join(map(str, version)),
                 "on" if self.reader.use_autoclaim else "off (XPENDING+XCLAIM)")  # fmt: skip
        return True

    def _release_orphans(self) -> None:
        """After a step failed part-way, stop renewing entries whose outcome was lost with it
        (held, but neither in the backlog nor written): their leases lapse and they are
        reclaimed after ``claim_idle_ms``, by this worker or another. Without this they would
        be renewed forever and never answered."""
        keep = self.backlog.held_ids() | self.pipeline.held_ids()
        released = self.in_flight.release_all_but(keep)
        if released:
            log.warning("released %d held entries after a failed step; they will be reclaimed",
                        released)  # fmt: skip

    # ----------------------------------------------------------------- one step
    def _step(self) -> bool:
        """Read and prepare jobs, hand a batch to the compute stage, write what is done.
        True when the worker should exit."""
        cfg, client, stage = self.config, self.link.client, self.pipeline
        if self.batch_started_s is None or self.busy():  # a wedged batch leaves the beat stale
            self.health.beat("loop")
        self.handback.give(client, stage, self.backlog, stopping=self.drain.stopping)
        self.stats.maybe_sample(client)
        self.server.maybe(client)
        outbox = Outbox()
        got = 0
        # Read ahead while a batch computes, but never next to a suspect running alone.
        may_read = not self.drain.stopping and not stage.suspect_running
        if may_read:
            suspect_held = self.backlog.holds_suspect() or stage.suspect_running
            if self.reader.reclaim_due(suspect_held=suspect_held) or self.handback.due(client):
                got += self._prepare(self.reader.reclaim(client, suspect_held=suspect_held), outbox)
                self.handback.after_reclaim(client)
            idle = not (self.backlog or got or stage.busy)
            rooms = self._rooms(ahead=stage.computing)
            got += self._prepare(
                self.reader.read(client, rooms, cfg.block_ms if idle else 0), outbox
            )
        self._flush(outbox)
        batch = self._submit() if stage.computing else []  # queued behind: before writing
        self._write_done()  # finished batches, written while the next one computes
        if not stage.computing:  # idle: fill a batch within max_wait_ms, then run it
            self._write_done()  # a batch that finished a moment ago is written before the fill
            if may_read and self.backlog:
                filled = Outbox()
                got += self._fill(client, filled)
                self._flush(filled)
            batch = batch or self._submit()
        if not stage.threaded:
            self._write_done()
        elif got:
            self._poll_s = POLL_MIN_S
        elif stage.computing:  # nothing new came in: leave the CPU to the forward a while
            stage.wait(self._poll_s)
            self._poll_s = min(self._poll_s * 2, POLL_MAX_S)
        self.metrics.in_flight.set(len(self.in_flight))
        self.metrics.set_queue_backlog(self.backlog.counts())
        if stage.busy:
            return False
        if cfg.max_jobs is not None and self.jobs_done >= cfg.max_jobs and not self.backlog:
            return True
        if cfg.burst and not got and not batch and not self.backlog:
            return self.reader.drained(client)
        return False

    def _write_done(self) -> None:
        """Write the replies of the batches the compute stage finished (and ack them)."""
        done = self.pipeline.take_done()
        if done is not None:
            self._flush(Outbox(results=done))

    def _submit(self) -> list[Pending]:
        """Hand the next batch to the compute stage when it can take one: at once when nothing
        computes; behind the computing batch only once the backlog holds a full batch (and never
        a suspect, which waits to run alone). Returns the batch submitted (empty: none)."""
        stage, backlog = self.pipeline, self.backlog
        if not backlog:
            return []
        head = backlog.head()
        head_suspect = head is not None and backlog.is_suspect(head)
        if not stage.can_take(suspect=head_suspect):
            return []
        if stage.computing and not backlog.full():
            return []
        batch = backlog.take_batch()
        if batch:
            self.metrics.record_queue_batch(batch_share(batch, self.config.queue_of))
            stage.submit(batch, suspect=backlog.is_suspect(batch[0]))
        return batch

    def _fill(self, client: Any, outbox: Outbox) -> int:
        """Fill the batch: poll without BLOCK until the backlog holds a batch's token budget or
        ``max_wait_ms`` passed (a BLOCK timeout fires on the server's ~100 ms cron tick)."""
        got = 0
        deadline = time.monotonic() + self.config.max_wait_ms / 1000.0
        while self.backlog and not self.backlog.full() and any(self._rooms().values()):
            more = self.reader.read(client, self._rooms(), 0)
            if more:
                got += self._prepare(more, outbox)
                continue
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                break
            time.sleep(min(left_s, 0.001))
        return got

    def _room(self) -> int:
        """How many more entries to read (bounded by ``--max-jobs``)."""
        room = self.config.read_count
        if self.config.max_jobs is not None:
            room = min(room, self.config.max_jobs - self.jobs_done - len(self.in_flight))
        return room

    def _rooms(self, *, ahead: bool = False) -> dict[str, int]:
        """Entries to read per queue (``Backlog.rooms``): while a batch computes (``ahead``) what
        fills each queue's share of the backlog to one batch's budget (one batch ahead at most)."""
        return self.backlog.rooms(self._room(), ahead=ahead, queued=self.pipeline.queued)

    def _prepare(self, entries: list[streams.Entry], outbox: Outbox) -> int:
        """Decode and validate entries: good jobs join the backlog, bad ones get answers."""
        for entry in entries:
            outcome = prepare_entry(self.jobs, entry)
            if isinstance(outcome, Pending):
                self.backlog.append(outcome)
            else:
                outbox.add(outcome)
        return len(entries)

    def _flush(self, outbox: Outbox) -> None:
        """Write results and dead letters (retrying while Redis is away), count finished jobs."""
        try:
            while outbox:
                try:
                    self.writer.flush(self.link.client, outbox)
                except REDIS_DOWN as exc:
                    self.link.down(exc)
                    if self.drain.deadline_passed():
                        log.error("drain deadline passed with results unwritten; they stay pending")
                        return
        finally:
            self.jobs_done += outbox.finished
            self.startup.first_result(self.metrics, outbox.finished)
