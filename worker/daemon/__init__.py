"""The worker daemon: read jobs from Redis Streams, batch them, score, write results, ack.

One loop in the main thread (read -> decode/validate -> batch under the token budget -> score ->
write results and ack), a lease thread (``worker.daemon.leases``) that keeps in-flight entries owned
while a batch runs, periodic reclaim of entries whose consumer died, dead-lettering past
``max_deliveries``, graceful drain on SIGTERM/SIGINT and reconnects when Redis goes away.
Commands on the wire live in ``worker.streams``; this module is the logic around them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis

from worker import streams
from worker.config import RedisSettings, WorkerConfig
from worker.connections import connect
from worker.daemon.leases import InFlight, LeaseKeeper
from worker.keys import dead_letter_stream
from worker.observability.health import HealthServer, HealthState
from worker.observability.metrics import WorkerMetrics
from worker.protocol import Job, Result

log = logging.getLogger(__name__)
_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
_INFO_KEYS = ("model", "reward_model", "dtype", "device")


@dataclass
class Pending:
    """A decoded job held by this worker, waiting for (or in) a batch."""

    entry: streams.Entry
    job: Job
    inputs: list[Any]
    read_at_s: float

    @property
    def key(self) -> tuple[str, float]:
        """Jobs sharing ``(mode, temperature)`` can share one executor call."""
        return self.job.mode, self.job.temperature


@dataclass
class Outbox:
    """Results and dead letters produced by one step, written together."""

    results: list[tuple[streams.Entry, str | None, Result, float | None]] = field(
        default_factory=list
    )  # (entry, reply_to, result, read_at_s)
    dead: list[tuple[streams.Entry, str, Result | None, str | None]] = field(
        default_factory=list
    )  # (entry, reason, result for the producer, reply_to)


def _ignore_in_handler(_signum: int, _frame: Any) -> None:
    """Installed for SIGTERM/SIGINT so they do not kill the process; the watcher thread acts."""


class Worker:
    """A consumer of one or more job streams in one consumer group."""

    def __init__(
        self,
        config: WorkerConfig,
        redis_settings: RedisSettings,
        scorer: Any,
        *,
        metrics: WorkerMetrics | None = None,
        health: HealthState | None = None,
        client_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.config = config
        self.redis_settings = redis_settings
        self.scorer = scorer
        self.metrics = metrics or WorkerMetrics()
        self.health = health or HealthState()
        self.metrics.bind_health(self.health)  # ready/model_loaded read health at scrape
        self._factory = client_factory or (lambda: connect(redis_settings))
        self.client: Any = None
        self.in_flight = InFlight()
        self.backlog: list[Pending] = []
        self._stop = threading.Event()
        self._signals = 0
        self._drain_timer: threading.Timer | None = None
        self._drain_lock = threading.Lock()
        self._running = False
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._drain_deadline: float | None = None
        self._rotation = 0
        self._use_autoclaim = True
        self._last_reclaim = 0.0
        self._suspects_waiting = False
        self._last_stats = 0.0
        self._redis_failures = 0
        self.jobs_done = 0
        self.batch_started_s: float | None = None
        self.http: HealthServer | None = None
        scorer.add_fallback_listener(self._on_fallback)

    # ----------------------------------------------------------------- lifecycle
    def request_stop(self, reason: str = "requested") -> None:
        """Stop reading, finish what is held, exit the loop (readiness goes false at once)."""
        if not self._stop.is_set():
            log.info("draining (%s): finishing %d held jobs", reason, len(self.in_flight))
        self._stop.set()
        self.health.draining = True
        self.metrics.draining.set(1)
        with self._drain_lock:
            if self._drain_deadline is None:
                self._drain_deadline = time.monotonic() + self.config.drain_timeout_s
                timer = threading.Timer(self.config.drain_timeout_s, self._drain_expired)
                timer.daemon = True
                self._drain_timer = timer
                timer.start()

    def _drain_expired(self) -> None:
        """The drain deadline passed: end the process if this worker is still serving.

        A worker that is not inside :meth:`run` (never started, or already drained) holds
        nothing, so a deadline that fires then is ignored: an in-process worker stopped
        outside ``run()`` must never take its host process down later.
        """
        with self._drain_lock:
            if not self._running:
                return
        log.error("drain timeout of %.1fs passed; exiting (held entries will be reclaimed)",
                  self.config.drain_timeout_s)  # fmt: skip
        os._exit(1)

    def _on_signal(self, signum: int) -> None:
        """Act on SIGTERM/SIGINT (called from the signal-watcher thread, never from a handler)."""
        self._signals += 1
        if self._signals > 1:
            log.warning("second signal %d: exiting now (held entries will be reclaimed)", signum)
            os._exit(1)
        self.request_stop(signal.Signals(signum).name)

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT drain; a second one exits at once (main thread only).

        The Python-level handlers do nothing: the interpreter also writes each signal number
        to a wakeup socket (``signal.set_wakeup_fd``) that a watcher thread reads and acts on.
        Work done inside a handler runs on the main thread between bytecodes and can deadlock
        on a non-reentrant lock the interrupted code holds (a metric's, an Event's, stderr's).
        """
        if threading.current_thread() is not threading.main_thread():
            return
        rsock, wsock = socket.socketpair()
        wsock.setblocking(False)
        signal.set_wakeup_fd(wsock.fileno(), warn_on_full_buffer=False)
        self._wakeup = (rsock, wsock)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _ignore_in_handler)
        threading.Thread(target=self._watch_signals, args=(rsock,), name="signals",
                         daemon=True).start()  # fmt: skip

    def _watch_signals(self, rsock: socket.socket) -> None:
        wanted = {int(signal.SIGTERM), int(signal.SIGINT)}
        while True:
            try:
                data = rsock.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in wanted:
                    self._on_signal(signum)

    def _on_fallback(self, event: Any) -> None:
        self.metrics.record_fallback(event.requested, event.used, event.reason)
        self.metrics.set_backend(event.used)

    def run(self) -> int:
        """Serve until stopped (signal, ``--burst`` drained, ``--max-jobs`` reached); returns 0."""
        with self._drain_lock:
            self._running = True
        try:
            return self._serve()
        finally:
            # Drained in time: the drain deadline must not fire later (in-process use, tests).
            with self._drain_lock:
                self._running = False
                if self._drain_timer is not None:
                    self._drain_timer.cancel()

    def _serve(self) -> int:
        cfg = self.config
        if cfg.metrics_port is not None and self.http is None:
            self.http = HealthServer(
                self.metrics.registry, self.health, host=cfg.metrics_host, port=cfg.metrics_port
            ).start()
            log.info("metrics on http://%s:%d/metrics", self.http.host, self.http.port)
        self.metrics.up.set(1)
        self.health.model_ready = True
        backend = str(getattr(self.scorer, "info", {}).get("attention_backend") or "none")
        self.metrics.set_backend(backend)
        for event in load_fallbacks(self.scorer):
            self.metrics.record_fallback(event.requested, event.used, event.reason)
        while not self._connect():
            if self._stop.is_set():
                return 0
        leases = LeaseKeeper(
            self._factory, self.in_flight, group=cfg.group, consumer=cfg.consumer,
            interval_s=cfg.lease_interval_s, metrics=self.metrics, health=self.health,
            busy=self.busy,
        ).start()  # fmt: skip
        self.health.started = True
        log.info(
            "worker %s serving %s (group %s) on %s",
            cfg.consumer, ",".join(cfg.streams), cfg.group, self.redis_settings.redacted_url,
        )  # fmt: skip
        try:
            while True:
                if self._stop.is_set() and not self.backlog:
                    break
                try:
                    if self._step():
                        break
                    self._redis_ok()
                except _REDIS_DOWN as exc:
                    self._release_orphans()
                    self._redis_down(exc)
                except Exception as exc:  # the one broad except: log, count, keep serving
                    self._release_orphans()
                    if streams.is_transient(exc):  # OOM, READONLY after a failover, ...
                        self._redis_down(exc)
                        continue
                    if streams.is_nogroup(exc):
                        log.warning("group or stream gone (%s); recreating", exc)
                        self._ensure_groups()
                        continue
                    log.exception("worker loop error")
                    self.metrics.loop_errors.labels(where="loop").inc()
                    time.sleep(0.1)
            self._forget_consumer()
        finally:
            leases.stop()
            self.metrics.up.set(0)
            self.metrics.in_flight.set(0)
            self.health.started = False
        log.info("worker %s stopped after %d jobs", cfg.consumer, self.jobs_done)
        return 0

    # ----------------------------------------------------------------- redis plumbing
    def _connect(self) -> bool:
        try:
            self.client = self._factory()
            version = streams.server_version(self.client)
            self._use_autoclaim = streams.supports_autoclaim(version)
            self._ensure_groups()
            self._redis_ok()
            log.info("redis %s, XAUTOCLAIM %s", ".".join(map(str, version)),
                     "on" if self._use_autoclaim else "off (XPENDING+XCLAIM)")  # fmt: skip
            return True
        except _REDIS_DOWN as exc:
            self._redis_down(exc)
            return False

    def _release_orphans(self) -> None:
        """After a step failed part-way, stop renewing entries whose outcome was lost with it
        (held, but neither in the backlog nor written): their leases lapse and they are
        reclaimed after ``claim_idle_ms``, by this worker or another. Without this they would
        be renewed forever and never answered."""
        keep = {(p.entry.stream, p.entry.id) for p in self.backlog}
        released = 0
        for stream, ids in self.in_flight.snapshot().items():
            for entry_id in ids:
                if (stream, entry_id) not in keep:
                    self.in_flight.discard(stream, entry_id)
                    released += 1
        if released:
            log.warning("released %d held entries after a failed step; they will be reclaimed",
                        released)  # fmt: skip

    def _forget_consumer(self) -> None:
        """On a clean stop, delete this consumer from its groups where it holds nothing, so
        replaced pods do not pile up as dead consumers (``XGROUP DELCONSUMER``)."""
        if not self.config.forget_consumer or self.client is None:
            return
        for stream in self.config.streams:
            try:
                if streams.forget_consumer(self.client, stream, self.config.group,
                                           self.config.consumer):  # fmt: skip
                    log.info("left group %s on %s", self.config.group, stream)
            except redis.RedisError as exc:
                log.warning("could not leave group %s on %s: %s", self.config.group, stream, exc)

    def _ensure_groups(self) -> None:
        for stream in self.config.streams:
            if streams.ensure_group(self.client, stream, self.config.group):
                log.info("created consumer group %s on %s", self.config.group, stream)

    def _redis_ok(self) -> None:
        if self._redis_failures:
            log.info("redis reachable again after %d failures", self._redis_failures)
        self._redis_failures = 0
        self.health.redis_ok = True

    def _redis_down(self, exc: BaseException) -> None:
        self._redis_failures += 1
        self.health.redis_ok = False
        self.metrics.redis_reconnects.inc()
        delay = min(0.1 * 2 ** min(self._redis_failures - 1, 5), 3.0)
        log.warning("redis unreachable (%s); retry %d in %.1fs", exc, self._redis_failures, delay)
        self._stop.wait(delay) if not self._stop.is_set() else time.sleep(delay)
        self.health.beat("loop")

    def dead_stream_of(self, stream: str) -> str:
        return self.config.dead_letter_stream or dead_letter_stream(stream)

    # ----------------------------------------------------------------- one step
    def _step(self) -> bool:
        """Read, prepare and run one batch. True when the worker should exit."""
        cfg = self.config
        self.health.beat("loop")
        now = time.monotonic()
        if now - self._last_stats >= cfg.stats_interval_s:
            self._last_stats = now
            self._sample_stats()
        outbox = Outbox()
        got = 0
        if not self._stop.is_set():
            # Suspects (entries whose batch never finished) are taken one by one: the next
            # as soon as the previous one is done, not a reclaim interval later.
            suspects_next = self._suspects_waiting and not self._suspect_held()
            if suspects_next or now - self._last_reclaim >= cfg.reclaim_every_s:
                self._last_reclaim = now
                got += self._prepare(self._reclaim(), outbox)
            block = 0 if (self.backlog or got) else cfg.block_ms
            got += self._prepare(self._read(block), outbox)
            # Fill the batch: poll without BLOCK (a server-side BLOCK timeout only fires on the
            # server's cron tick, ~100 ms at hz 10, far coarser than max_wait_ms).
            deadline = time.monotonic() + cfg.max_wait_ms / 1000.0
            while self.backlog and self._backlog_tokens() < cfg.max_batch_tokens:
                if self._room() <= 0:
                    break
                more = self._read(0)
                if more:
                    got += self._prepare(more, outbox)
                    continue
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    break
                time.sleep(min(left_s, 0.001))
        self._flush(outbox)
        batch = self._take_batch()
        if batch:
            self._run_batch(batch)
        self.metrics.in_flight.set(len(self.in_flight))
        if cfg.max_jobs is not None and self.jobs_done >= cfg.max_jobs and not self.backlog:
            return True
        if cfg.burst and not got and not batch and not self.backlog:
            return self._drained()
        return False

    def _room(self) -> int:
        """How many more entries to read (bounded by ``--max-jobs``)."""
        room = self.config.read_count
        if self.config.max_jobs is not None:
            room = min(room, self.config.max_jobs - self.jobs_done - len(self.in_flight))
        return room

    def _read(self, block_ms: int) -> list[streams.Entry]:
        room = self._room()
        if room <= 0:
            return []
        self._rotation += 1
        entries = streams.read_new(
            self.client, self.config.streams, self.config.group, self.config.consumer,
            count=room, block_ms=block_ms, rotation=self._rotation,
        )  # fmt: skip
        for e in entries:
            self.in_flight.add(e.stream, e.id)
        return entries

    def _suspect_held(self) -> bool:
        limit = self.config.isolate_after_deliveries
        return any(p.entry.deliveries > limit for p in self.backlog)

    def _reclaim(self) -> list[streams.Entry]:
        held = self.in_flight.snapshot()
        out: list[streams.Entry] = []
        waiting: list[str] = []
        take_suspect = not self._suspect_held()
        for stream in self.config.streams:
            claimed, deleted = streams.reclaim_idle(
                self.client, stream, self.config.group, self.config.consumer,
                min_idle_ms=self.config.claim_idle_ms, count=self.config.read_count,
                use_autoclaim=self._use_autoclaim,
                isolate_after=self.config.isolate_after_deliveries, take_suspect=take_suspect,
                waiting=waiting,
            )  # fmt: skip
            if any(e.deliveries > self.config.isolate_after_deliveries for e in claimed):
                take_suspect = False  # one suspect at a time, over all partitions
            if deleted:
                log.warning("%d pending entries of %s were deleted before reclaim", len(deleted),
                            stream)  # fmt: skip
            mine = set(held.get(stream, ()))
            for e in claimed:
                if e.id in mine:
                    continue  # our own entry whose lease lapsed; it is already held
                self.in_flight.add(e.stream, e.id)
                out.append(e)
        if out:
            self.metrics.reclaimed.inc(len(out))
            log.info("reclaimed %d idle entries", len(out))
        self._suspects_waiting = bool(waiting)
        return out

    def _drained(self) -> bool:
        return all(
            streams.pending_count(self.client, s, self.config.group, self.config.consumer) == 0
            for s in self.config.streams
        )

    def _sample_stats(self) -> None:
        m, group = self.metrics, self.config.group
        for stream in self.config.streams:
            dead = self.dead_stream_of(stream)
            try:
                st = streams.stream_stats(self.client, stream, group)
                dead_len = int(self.client.xlen(dead))
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
            m.stream_pending.labels(stream=stream, group=group).set(st["pending"])
            m.stream_consumers.labels(stream=stream, group=group).set(st["consumers"])
            m.dead_letter_length.labels(stream=dead).set(dead_len)

    # ----------------------------------------------------------------- decode and validate
    def _prepare(self, entries: list[streams.Entry], outbox: Outbox) -> int:
        """Decode and validate entries: good jobs join the backlog, bad ones get results."""
        from worker.daemon.jobs import prepare_entry

        for entry in entries:
            if entry.deliveries > 1:
                self.metrics.redelivered.inc()
            prepare_entry(self, entry, outbox)
        return len(entries)

    def _backlog_tokens(self) -> int:
        return sum(p.job.num_tokens for p in self.backlog)

    def _take_batch(self) -> list[Pending]:
        """The oldest job plus following jobs of the same (mode, temperature) within budget."""
        if not self.backlog:
            return []
        first = self.backlog[0]
        if first.entry.deliveries > self.config.isolate_after_deliveries:
            # Delivered again after its batch never finished (the worker died mid-batch): it
            # runs alone, so a job that crashes the process cannot take batch-mates with it to
            # the dead-letter stream.
            self.backlog = self.backlog[1:]
            return [first]
        key = first.key
        batch: list[Pending] = []
        rest: list[Pending] = []
        tokens = 0
        for p in self.backlog:
            if p.entry.deliveries > self.config.isolate_after_deliveries:
                rest.append(p)
                continue
            n = p.job.num_tokens
            if p.key == key and (not batch or tokens + n <= self.config.max_batch_tokens):
                batch.append(p)
                tokens += n
            else:
                rest.append(p)
        self.backlog = rest
        return batch

    def _run_batch(self, batch: list[Pending]) -> None:
        from worker.daemon.jobs import score_batch

        outbox = Outbox()
        self.batch_started_s = time.monotonic()
        try:
            score_batch(self, batch, outbox)
        finally:
            self.batch_started_s = None
        self._flush(outbox)

    def busy(self) -> bool:
        """True while a batch computes and has run less than ``batch_timeout_s``: the lease thread
        then beats ``loop`` for the main thread, so a long batch is not mistaken for a wedged loop
        (a batch stuck past the limit still is)."""
        started = self.batch_started_s
        return started is not None and time.monotonic() - started < self.config.batch_timeout_s

    # ----------------------------------------------------------------- writing
    def _flush(self, outbox: Outbox) -> None:
        """Write results and dead letters (retrying while Redis is away), then forget them."""
        from worker.daemon.jobs import flush_outbox

        while True:
            try:
                flush_outbox(self, outbox)
                return
            except _REDIS_DOWN as exc:
                self._redis_down(exc)
                if self._drain_deadline is not None and time.monotonic() > self._drain_deadline:
                    log.error("drain deadline passed with results unwritten; they stay pending")
                    return


def seq_inputs(job: Job, input_cls: Any) -> list[Any]:
    """Executor inputs of a job: int32 token arrays (zero-copy) and prompt_len or mask."""
    out = []
    for s in job.seqs:
        tokens = np.frombuffer(s.tokens, dtype=np.int32) if len(s.tokens) else np.zeros(0, np.int32)
        mask = np.frombuffer(s.mask, dtype=np.uint8).astype(bool) if s.mask is not None else None
        out.append(input_cls(tokens=tokens, prompt_len=s.prompt_len, mask=mask))
    return out


def job_info(scorer: Any, consumer: str, **extra: Any) -> dict[str, Any]:
    """The ``info`` map of a result: model, dtype, device, worker, plus ``extra``."""
    base = getattr(scorer, "info", {}) or {}
    info = {k: base[k] for k in _INFO_KEYS if base.get(k) is not None}
    info["worker"] = consumer
    info.update({k: v for k, v in extra.items() if v is not None})
    return info


def load_fallbacks(scorer: Any) -> list[Any]:
    """Attention-backend fallbacks the scorer took while loading (packing changes excluded)."""
    events = getattr(scorer, "load_fallbacks", None) or []
    return [e for e in events if getattr(e, "requested", "") != "packed"]
