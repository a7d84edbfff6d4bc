"""Start-up phases: where the time from process start to ready, and to the first result, goes.

``serve`` times each phase of a cold start into one :class:`StartupClock` (torch-free; the
executor reports its own phases as plain numbers), and the worker publishes them when it turns
ready: ``scoring_startup_phase_seconds{phase}`` (each phase's duration),
``scoring_startup_seconds{until}`` (``ready``, ``first_result``: seconds since the process
started, read from ``/proc``), and one log line ``startup: ready after ...``.

Phases, in order: ``interpreter`` (the interpreter and the CLI's own imports, before ``serve``
runs), ``import`` (torch, transformers and the executor), ``model_read`` (reading the checkpoint:
safetensors or GGUF, dequantised), ``placement`` (moving the weights to the device and dtype),
``self_check`` (the load-time probe, ``worker.executor.selfcheck``), ``warmup`` (the forward at
the token budget before ready, ``--warmup``), ``connect`` (Redis, groups, the lease thread).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.observability.metrics import WorkerMetrics

log = logging.getLogger(__name__)

PHASES: tuple[str, ...] = (
    "interpreter",
    "import",
    "model_read",
    "placement",
    "self_check",
    "warmup",
    "connect",
)
UNTIL: tuple[str, ...] = ("ready", "first_result")

_FALLBACK_T0 = time.monotonic()  # where /proc cannot be read: this module's import


def process_age_s() -> float:
    """Seconds since this process started (``/proc/self/stat`` start time against
    ``/proc/uptime``, 10 ms resolution); off Linux, since this module was imported."""
    try:
        with open("/proc/self/stat") as fh:
            stat = fh.read()
        with open("/proc/uptime") as fh:
            uptime_s = float(fh.read().split()[0])
        # field 22 (starttime, in clock ticks since boot) counts from after the ")" of comm
        start_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
        return max(uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _FALLBACK_T0


class StartupClock:
    """The durations of the start-up phases of one process (seconds by phase name)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.until: dict[str, float] = {}  # "ready", "first_result": seconds since start
        self._last = time.perf_counter()  # when the last phase ended

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block into ``name`` (added to what it already holds)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to phase ``name`` (a phase that ended just now)."""
        self.phases[name] = self.phases.get(name, 0.0) + max(float(seconds), 0.0)
        self._last = time.perf_counter()

    def mark(self, until: str) -> float:
        """Record that ``until`` (``ready``, ``first_result``) happened now; seconds since the
        process started (kept from the first call only)."""
        if until not in self.until:
            self.until[until] = process_age_s()
        return self.until[until]

    def ready(self, metrics: WorkerMetrics) -> None:
        """The worker turned ready: what passed since the last phase is ``connect`` (the worker
        built, Redis connected, groups created, the lease thread started); mark it, publish
        every phase, log the summary line."""
        self.add("connect", time.perf_counter() - self._last)
        self.mark("ready")
        self.publish(metrics)
        log.info("startup: %s", self.summary())

    def first_result(self, metrics: WorkerMetrics, answered: int) -> None:
        """``answered`` jobs were answered just now: the first time any were, mark and publish
        it."""
        if answered and "first_result" not in self.until:
            self.mark("first_result")
            self.publish(metrics)

    def publish(self, metrics: WorkerMetrics) -> None:
        """Set ``scoring_startup_phase_seconds`` and ``scoring_startup_seconds``."""
        for phase, seconds in self.phases.items():
            metrics.startup_phase.labels(phase=phase).set(seconds)
        for until, seconds in self.until.items():
            metrics.startup.labels(until=until).set(seconds)

    def summary(self) -> str:
        """``ready after 4.21 s: interpreter 0.30 s, import 2.10 s, ...`` (phases in order)."""
        names = [p for p in PHASES if p in self.phases] + sorted(set(self.phases) - set(PHASES))
        parts = ", ".join(f"{p} {self.phases[p]:.3f} s" for p in names)
        ready = self.until.get("ready")
        head = f"ready after {ready:.3f} s" if ready is not None else "not ready"
        return f"{head}: {parts}" if parts else head


__all__ = ["PHASES", "UNTIL", "StartupClock", "process_age_s"]
