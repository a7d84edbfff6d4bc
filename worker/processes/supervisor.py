"""Run, restart and drain child worker processes (``serve --gpus all|0,1,..`` / ``--replicas N``).

The supervisor is process plumbing only: it never imports torch, never touches Redis and knows
no ``serve`` flag. ``worker.processes.fleet`` builds one :class:`ChildSpec` per child (its
argv, its environment such as ``CUDA_VISIBLE_DEVICES``, its consumer name and metrics port) and a
:class:`SupervisorConfig` from ``serve``'s parsed flags; the children are fresh processes, not
forks, so no CUDA state is ever shared.

A child that exits non-zero (or is killed) is restarted with exponential backoff
(``restart_backoff_s`` doubling up to ``restart_backoff_max_s``); its backoff resets once it has
stayed up ``stable_after_s``. A child that crashes more than ``restart_limit`` times within
``restart_window_s`` is given up on. Policy (documented in docs/scaling.md): by default the other
children keep serving (one bad GPU does not take down the node's healthy ones) and the supervisor
exits non-zero once no child is left running, so Kubernetes restarts the pod; with
``exit_on_give_up`` it drains every child and exits non-zero at the first give-up. A child that
exits 0 on its own (``--burst``/``--max-jobs``) is done and is not restarted.

SIGTERM/SIGINT are forwarded to every child so each drains (SIGHUP too, forwarded as SIGTERM);
stragglers get SIGKILL after the drain timeout plus a margin. Children get SIGTERM if the
supervisor dies (``PR_SET_PDEATHSIG``). The supervisor exits 0 when every child exited 0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from worker.errors import ConfigError
from worker.processes.parent_death import set_pdeathsig

log = logging.getLogger(__name__)

DRAIN_MARGIN_S = 10.0


@dataclass(frozen=True)
class SupervisorConfig:
    """Restart and shutdown policy of the supervisor."""

    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 60.0
    stable_after_s: float = 60.0
    restart_limit: int = 10
    restart_window_s: float = 600.0
    exit_on_give_up: bool = False
    drain_timeout_s: float = 30.0
    drain_margin_s: float = DRAIN_MARGIN_S
    poll_interval_s: float = 0.1

    def __post_init__(self) -> None:
        if self.restart_backoff_s <= 0 or self.restart_backoff_max_s < self.restart_backoff_s:
            raise ConfigError("restart backoff must be > 0 and max >= base")
        if self.restart_limit < 0 or self.restart_window_s <= 0:
            raise ConfigError("restart limit must be >= 0 and window > 0")

    def backoff_s(self, failures: int) -> float:
        """Delay before restart number ``failures`` (1-based) of a crash-looping child."""
        return float(min(self.restart_backoff_max_s, self.restart_backoff_s * 2 ** (failures - 1)))


@dataclass(frozen=True)
class ChildSpec:
    """What one child runs (``argv`` with ``env``) and how logs name it.

    ``consumer`` tags the child's output; ``device`` (its ``CUDA_VISIBLE_DEVICES``) and
    ``metrics_port`` are only reported: they are already in ``argv``/``env``.
    """

    index: int
    consumer: str
    device: str | None  # the CUDA_VISIBLE_DEVICES value, None on CPU replicas
    metrics_port: int | None
    argv: tuple[str, ...]
    env: Mapping[str, str]

    @property
    def label(self) -> str:
        """How logs name this child."""
        dev = f" gpu={self.device}" if self.device is not None else ""
        return f"{self.consumer}{dev}"


@dataclass
class _Child:
    spec: ChildSpec
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    failures: int = 0  # consecutive crashes since it last stayed up stable_after_s
    crashes: deque[float] = field(default_factory=deque)  # crash times within the window
    restart_at: float | None = None
    done: bool = False  # exited 0, or given up on
    exit_code: int | None = None
    gave_up: bool = False
    pump: threading.Thread | None = None


# ----------------------------------------------------------------------------- running


def _pump(child: ChildSpec, stream: IO[bytes], out: IO[str]) -> None:
    """Copy a child's output line by line, tagged with which child wrote it."""
    prefix = f"[{child.consumer}] "
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        if line.startswith("{"):
            try:
                obj = json.loads(line)
                if isinstance(obj, dict):
                    obj.setdefault("consumer", child.consumer)
                    obj.setdefault("replica", child.index)
                    line = json.dumps(obj, default=str)
                else:
                    line = prefix + line
            except ValueError:
                line = prefix + line
        else:
            line = prefix + line
        try:
            out.write(line + "\n")
            out.flush()
        except (OSError, ValueError):
            pass
    stream.close()


class Supervisor:
    """Runs, restarts and drains the children; ``run()`` returns the process exit code."""

    def __init__(
        self,
        specs: Sequence[ChildSpec],
        config: SupervisorConfig,
        output: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.children = [_Child(spec) for spec in specs]
        self.config = config
        self.output = output if output is not None else sys.stderr
        self.clock = clock
        self._stop_signal: int | None = None

    # -- signals
    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Begin draining (what the SIGTERM/SIGINT handler calls)."""
        if self._stop_signal is None:
            self._stop_signal = signum

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.request_stop(signum)

    # -- children
    def _start(self, child: _Child) -> None:
        spec = child.spec
        child.proc = subprocess.Popen(
            list(spec.argv),
            env=dict(spec.env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor only
            preexec_fn=set_pdeathsig if sys.platform.startswith("linux") else None,
        )
        child.started_at = self.clock()
        child.restart_at = None
        assert child.proc.stdout is not None
        child.pump = threading.Thread(
            target=_pump,
            args=(spec, child.proc.stdout, self.output),
            name=f"pump-{spec.consumer}",
            daemon=True,
        )
        child.pump.start()
        log.info(
            "child %d (%s) started: pid %d, metrics port %s",
            spec.index,
            spec.label,
            child.proc.pid,
            spec.metrics_port,
        )

    def _reap(self, child: _Child, code: int, now: float) -> None:
        spec = child.spec
        child.exit_code = code
        pid = child.proc.pid if child.proc else -1
        child.proc = None
        if self._stop_signal is not None:
            child.done = True
            log.info("child %d (%s) pid %d exited with %d", spec.index, spec.label, pid, code)
            return
        if code == 0:
            child.done = True
            log.info("child %d (%s) pid %d finished (exit 0)", spec.index, spec.label, pid)
            return
        uptime = now - child.started_at
        if uptime >= self.config.stable_after_s:
            child.failures = 0
        child.failures += 1
        child.crashes.append(now)
        while child.crashes and now - child.crashes[0] > self.config.restart_window_s:
            child.crashes.popleft()
        if len(child.crashes) > self.config.restart_limit:
            child.done = child.gave_up = True
            log.error(
                "child %d (%s) pid %d crashed %d times in %.0fs (exit %d): giving up on it",
                spec.index,
                spec.label,
                pid,
                len(child.crashes),
                self.config.restart_window_s,
                code,
            )
            if self.config.exit_on_give_up:
                self.request_stop(signal.SIGTERM)
            return
        delay = self.config.backoff_s(child.failures)
        child.restart_at = now + delay
        log.warning(
            "child %d (%s) pid %d died (exit %d after %.1fs up); restart %d in %.1fs",
            spec.index,
            spec.label,
            pid,
            code,
            uptime,
            child.failures,
            delay,
        )

    def _poll(self) -> None:
        now = self.clock()
        for child in self.children:
            if child.proc is not None:
                code = child.proc.poll()
                if code is not None:
                    self._reap(child, code, now)
            elif (
                not child.done
                and self._stop_signal is None
                and child.restart_at is not None
                and now >= child.restart_at
            ):
                self._start(child)

    def _live(self) -> list[_Child]:
        return [c for c in self.children if c.proc is not None]

    def _drain(self) -> None:
        signum = self._stop_signal or signal.SIGTERM
        if signum == signal.SIGHUP:  # a closed terminal: the workers drain as on SIGTERM
            signum = signal.SIGTERM
        for child in self.children:
            if child.proc is None and not child.done:
                child.done = True  # was waiting for a restart: nothing to drain
        live = self._live()
        log.info(
            "draining %d children (%s), deadline %.0fs",
            len(live),
            signal.Signals(signum).name,
            self.config.drain_timeout_s + self.config.drain_margin_s,
        )
        for child in live:
            assert child.proc is not None
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signum)
        deadline = self.clock() + self.config.drain_timeout_s + self.config.drain_margin_s
        while self._live() and self.clock() < deadline:
            self._poll()
            time.sleep(self.config.poll_interval_s)
        for child in self._live():
            assert child.proc is not None
            log.error(
                "child %d (%s) pid %d did not drain in time: SIGKILL",
                child.spec.index,
                child.spec.label,
                child.proc.pid,
            )
            child.proc.kill()
            child.proc.wait()
            self._reap(child, -signal.SIGKILL, self.clock())

    def run(self, install_signals: bool = True) -> int:
        """Start every child, supervise until stopped or all are done, return the exit code."""
        previous: dict[int, Any] = {}
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            for child in self.children:
                self._start(child)
            while self._stop_signal is None:
                self._poll()
                if all(c.done for c in self.children):
                    break
                time.sleep(self.config.poll_interval_s)
            if self._stop_signal is not None:
                self._drain()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            for child in self.children:
                if child.pump is not None:
                    child.pump.join(timeout=2.0)
        codes = {c.spec.consumer: c.exit_code for c in self.children}
        ok = all(code == 0 for code in codes.values()) and not any(c.gave_up for c in self.children)
        log.info("supervisor done: exit codes %s", codes)
        return 0 if ok else 1


def supervise(specs: Sequence[ChildSpec], config: SupervisorConfig) -> int:
    """Log the children, then run them until stopped or done; returns the exit code."""
    for spec in specs:
        log.info(
            "child %d: consumer %s, CUDA_VISIBLE_DEVICES=%s, metrics port %s",
            spec.index,
            spec.consumer,
            spec.device if spec.device is not None else "(inherited)",
            spec.metrics_port,
        )
    return Supervisor(specs, config).run()
