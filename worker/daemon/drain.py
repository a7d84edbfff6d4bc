"""Drain control: the stop request, the drain deadline, and the signal watcher.

SIGTERM/SIGINT (or :meth:`DrainControl.request_stop`) turn readiness false at once, stop reading,
let the worker finish its computing batch (handing the rest back, :mod:`worker.daemon.handback`;
or finishing all it holds with ``handback=False``), and arm a deadline of ``drain_timeout_s``: a
worker still serving when it passes exits the process with status 1 (its held entries are
reclaimed by others).
A second signal exits at once. A deadline that fires while no worker is serving is ignored, so an
in-process worker stopped outside ``run()`` never takes its host process down later.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from worker.observability.health import HealthState
from worker.observability.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class DrainControl:
    """The stop flag, readiness/draining state and the drain deadline of one worker."""

    def __init__(
        self,
        timeout_s: float,
        *,
        health: HealthState,
        metrics: WorkerMetrics,
        held: Callable[[], int] = lambda: 0,
    ) -> None:
        self.timeout_s = timeout_s
        self._health = health
        self._metrics = metrics
        self._held = held
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._running = False
        self._deadline: float | None = None
        self.timer: threading.Timer | None = None  # the armed deadline, once a stop was asked

    @property
    def stopping(self) -> bool:
        """True once a stop was requested."""
        return self._stop.is_set()

    def wait(self, seconds: float) -> None:
        """Sleep ``seconds``; until a stop is requested, the request cuts the sleep short."""
        if self._stop.is_set():
            time.sleep(seconds)  # draining: keep the backoff (no busy retry loop)
        else:
            self._stop.wait(seconds)

    def deadline_passed(self) -> bool:
        """True when a drain is under way and its deadline has passed."""
        return self._deadline is not None and time.monotonic() > self._deadline

    def request_stop(self, reason: str = "requested") -> None:
        """Stop reading, finish what is held, exit the loop (readiness goes false at once)."""
        if not self._stop.is_set():
            log.info("draining (%s): %d jobs held", reason, self._held())
        self._stop.set()
        self._health.draining = True
        self._metrics.draining.set(1)
        with self._lock:
            if self._deadline is None:
                self._deadline = time.monotonic() + self.timeout_s
                timer = threading.Timer(self.timeout_s, self._expired)
                timer.daemon = True
                self.timer = timer
                timer.start()

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Mark the worker as serving for the block; on leaving, the deadline is disarmed."""
        with self._lock:
            self._running = True
        try:
            yield
        finally:
            # Drained in time: the drain deadline must not fire later (in-process use, tests).
            with self._lock:
                self._running = False
                if self.timer is not None:
                    self.timer.cancel()

    def _expired(self) -> None:
        """The drain deadline passed: end the process if the worker is still serving."""
        with self._lock:
            if not self._running:
                return
        log.error(
            "drain timeout of %.1fs passed; exiting (held entries will be reclaimed)",
            self.timeout_s,
        )
        os._exit(1)


def _ignore_in_handler(_signum: int, _frame: Any) -> None:
    """Installed for SIGTERM/SIGINT so they do not kill the process; the watcher thread acts."""


class SignalWatcher:
    """SIGTERM/SIGINT request a drain; a second one exits at once (main thread only).

    The Python-level handlers do nothing: the interpreter also writes each signal number to a
    wakeup socket (``signal.set_wakeup_fd``) that a watcher thread reads and acts on. Work done
    inside a handler runs on the main thread between bytecodes and can deadlock on a
    non-reentrant lock the interrupted code holds (a metric's, an Event's, stderr's).
    """

    def __init__(self, on_stop: Callable[[str], None]) -> None:
        self._on_stop = on_stop
        self._signals = 0
        self.wakeup: tuple[socket.socket, socket.socket] | None = None  # (read, write) ends

    def install(self) -> None:
        """Install the handlers and start the watcher thread (a no-op off the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return
        rsock, wsock = socket.socketpair()
        wsock.setblocking(False)
        signal.set_wakeup_fd(wsock.fileno(), warn_on_full_buffer=False)
        self.wakeup = (rsock, wsock)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _ignore_in_handler)
        threading.Thread(target=self._watch, args=(rsock,), name="signals", daemon=True).start()

    def on_signal(self, signum: int) -> None:
        """Act on one SIGTERM/SIGINT (from the watcher thread, never from a handler)."""
        self._signals += 1
        if self._signals > 1:
            log.warning("second signal %d: exiting now (held entries will be reclaimed)", signum)
            os._exit(1)
        self._on_stop(signal.Signals(signum).name)

    def _watch(self, rsock: socket.socket) -> None:
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
                    self.on_signal(signum)
