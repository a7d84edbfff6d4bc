"""One worker process per GPU (``serve --gpus all|0,1,..``) or N CPU replicas (``--replicas N``).

The supervisor is process plumbing only: it never imports torch except to count GPUs for
``--gpus all``, never touches Redis, and never initialises CUDA in a child's address space (the
children are fresh ``python -m worker serve`` processes, not forks). Each child gets:

* ``CUDA_VISIBLE_DEVICES=<id>`` (GPU mode), so its ``--device cuda`` / ``cuda:0`` is that GPU;
* ``--consumer <base>-<i>`` (base: ``--consumer``, else ``POD_NAME``, else the hostname);
* ``--metrics-port <base+i>`` when ``--metrics-port`` was given (``0``/``-1`` stay as they are).

A child that exits non-zero (or is killed) is restarted with exponential backoff
(``restart_backoff_s`` doubling up to ``restart_backoff_max_s``); its backoff resets once it has
stayed up ``stable_after_s``. A child that crashes more than ``restart_limit`` times within
``restart_window_s`` is given up on. Policy (documented in docs/scaling.md): by default the other
children keep serving (one bad GPU does not take down the node's healthy ones) and the supervisor
exits non-zero once no child is left running, so Kubernetes restarts the pod; with
``exit_on_give_up`` it drains every child and exits non-zero at the first give-up. A child that
exits 0 on its own (``--burst``/``--max-jobs``) is done and is not restarted.

SIGTERM/SIGINT are forwarded to every child so each drains; stragglers get SIGKILL after the drain
timeout plus a margin. The supervisor exits 0 when every child exited 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from worker.errors import ConfigError

log = logging.getLogger(__name__)

#: Global (pre-subcommand) flags of ``worker.cli`` that take a value.
GLOBAL_VALUE_FLAGS = frozenset({"--log-level"})
#: ``serve`` flags the supervisor consumes (flag -> takes a value); stripped from a child's argv.
SUPERVISOR_FLAGS: dict[str, bool] = {
    "--replicas": True,
    "--gpus": True,
    "--consumer": True,
    "--metrics-port": True,
    "--restart-backoff-s": True,
    "--restart-backoff-max-s": True,
    "--restart-limit": True,
    "--restart-window-s": True,
    "--exit-on-give-up": False,
}
DRAIN_MARGIN_S = 10.0
#: Env that would make a child supervise again (``serve`` reads them as flag defaults).
SUPERVISOR_ENV = frozenset({"SCORING_REPLICAS", "SCORING_GPUS"})
#: Set in every child; a child that still asks for a supervisor (say an abbreviated
#: ``--replica 2`` that was not stripped) refuses instead of forking a tree of supervisors.
CHILD_MARKER_ENV = "SCORING_SUPERVISED_CHILD"


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

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SupervisorConfig:
        """Build from parsed ``serve`` flags; a flag ``serve`` lacks keeps its default."""
        kwargs: dict[str, Any] = {}
        for name in (
            "restart_backoff_s",
            "restart_backoff_max_s",
            "restart_limit",
            "restart_window_s",
            "exit_on_give_up",
            "drain_timeout_s",
        ):
            value = getattr(args, name, None)
            if value is not None:
                kwargs[name] = value
        return cls(**kwargs)

    def backoff_s(self, failures: int) -> float:
        """Delay before restart number ``failures`` (1-based) of a crash-looping child."""
        return float(min(self.restart_backoff_max_s, self.restart_backoff_s * 2 ** (failures - 1)))


@dataclass(frozen=True)
class ChildSpec:
    """What one child runs: its index, consumer name, device pin and metrics port."""

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


# ----------------------------------------------------------------------------- devices and argv


def parse_gpus(spec: str, env: Mapping[str, str] | None = None) -> list[str]:
    """Device ids for ``--gpus``: ``all`` enumerates, ``0,1`` (or GPU UUIDs) is taken as given.

    ``all`` honours a ``CUDA_VISIBLE_DEVICES`` already set on the supervisor (its entries are
    the ids), else counts with ``torch.cuda.device_count()``, else ``nvidia-smi -L``.
    """
    source = os.environ if env is None else env
    spec = spec.strip()
    if spec.lower() == "all":
        visible = source.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and visible.strip():
            ids = [d.strip() for d in visible.split(",") if d.strip()]
        else:
            ids = [str(i) for i in range(count_gpus())]
        if not ids:
            raise ConfigError("--gpus all: no CUDA device found (use --replicas N on CPU)")
        return ids
    ids = [d.strip() for d in spec.split(",") if d.strip()]
    if not ids:
        raise ConfigError(f"--gpus needs 'all' or a comma-separated list of ids, got {spec!r}")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"--gpus lists a device twice: {spec!r}")
    return ids


def count_gpus() -> int:
    """How many CUDA devices this machine has (torch, else ``nvidia-smi -L``; 0 if neither)."""
    try:
        import torch

        n = int(torch.cuda.device_count())
        if n:
            return n
    except Exception:  # torch missing or broken driver: fall back to nvidia-smi
        log.debug("torch.cuda.device_count() failed", exc_info=True)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        log.warning("nvidia-smi -L failed", exc_info=True)
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split the raw CLI argv into (global flags, flags after ``serve``)."""
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "serve":
            return list(argv[:i]), list(argv[i + 1 :])
        i += 2 if tok in GLOBAL_VALUE_FLAGS else 1
    raise ConfigError(f"raw argv has no 'serve' subcommand: {list(argv)!r}")


def strip_flags(argv: Sequence[str], flags: Mapping[str, bool] = SUPERVISOR_FLAGS) -> list[str]:
    """``argv`` without the supervisor's flags (``--flag value`` and ``--flag=value`` forms)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        name = tok.split("=", 1)[0]
        if tok == "--":
            out.extend(argv[i:])
            break
        if name in flags:
            i += 2 if (flags[name] and "=" not in tok) else 1
            continue
        out.append(tok)
        i += 1
    return out


def consumer_base(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> str:
    """``--consumer``, else ``POD_NAME``, else the hostname."""
    source = os.environ if env is None else env
    base = getattr(args, "consumer", None) or source.get("POD_NAME") or socket.gethostname()
    return str(base)


def build_children(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> list[ChildSpec]:
    """The child specs for parsed ``serve`` args (``--gpus`` wins over ``--replicas``)."""
    base_env = dict(os.environ if env is None else env)
    gpus = getattr(args, "gpus", None)
    replicas = getattr(args, "replicas", None)
    devices: list[str | None]
    if gpus:
        devices = list(parse_gpus(str(gpus), base_env))
    elif replicas:
        if int(replicas) < 1:
            raise ConfigError(f"--replicas must be >= 1, got {replicas}")
        devices = [None] * int(replicas)
    else:
        raise ConfigError("the supervisor needs --replicas N or --gpus all|0,1,..")
    raw = getattr(args, "_argv", None)
    if not raw:
        raise ConfigError("args._argv (the raw argv) is missing")
    global_flags, serve_flags = split_argv(raw)
    serve_flags = strip_flags(serve_flags)
    base = consumer_base(args, base_env)
    port_base = getattr(args, "metrics_port", None)
    cpu_threads = max(1, (os.cpu_count() or 1) // len(devices))
    specs = []
    for i, device in enumerate(devices):
        consumer = f"{base}-{i}"
        port = None if port_base is None else int(port_base)
        if port is not None and port > 0:
            port += i  # 0 (a free port) and -1 (no endpoint) stay as they are
        child_argv = [sys.executable, "-m", "worker", *global_flags, "serve", *serve_flags]
        child_argv += ["--consumer", consumer]
        if port is not None:
            child_argv += ["--metrics-port", str(port)]
        child_env = {k: v for k, v in base_env.items() if k not in SUPERVISOR_ENV}
        child_env["SCORING_REPLICA_INDEX"] = str(i)
        child_env[CHILD_MARKER_ENV] = "1"
        if device is not None:
            child_env["CUDA_VISIBLE_DEVICES"] = device
        else:
            # N CPU replicas share the cores: do not let each one spawn a thread per core.
            child_env.setdefault("OMP_NUM_THREADS", str(cpu_threads))
        specs.append(ChildSpec(i, consumer, device, port, tuple(child_argv), child_env))
    return specs


# ----------------------------------------------------------------------------- running


def _set_pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask Linux to SIGTERM the child if the supervisor dies (kill -9), so it drains."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


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
            preexec_fn=_set_pdeathsig if sys.platform.startswith("linux") else None,
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
            for sig in (signal.SIGTERM, signal.SIGINT):
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


def supervise(args: argparse.Namespace) -> int:
    """Entry point called by ``serve`` when ``--replicas`` or ``--gpus`` is given."""
    if os.environ.get(CHILD_MARKER_ENV):
        log.error("--replicas/--gpus reached a supervised child (abbreviated flag?); refusing")
        return 2
    try:
        specs = build_children(args)
        config = SupervisorConfig.from_args(args)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    for spec in specs:
        log.info(
            "child %d: consumer %s, CUDA_VISIBLE_DEVICES=%s, metrics port %s",
            spec.index,
            spec.consumer,
            spec.device if spec.device is not None else "(inherited)",
            spec.metrics_port,
        )
    return Supervisor(specs, config).run()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the supervisor's flags to ``serve`` (skips any that ``serve`` already defines)."""
    have = set(parser._option_string_actions)
    group = parser.add_argument_group("supervisor (one child per GPU / replica)")
    if "--replicas" not in have:
        group.add_argument("--replicas", type=int, default=None, help="run N CPU workers")
    if "--gpus" not in have:
        group.add_argument("--gpus", default=None, help="one child per GPU: all | 0,1,..")
    specs: list[tuple[str, type, str]] = [
        ("--restart-backoff-s", float, "first restart delay of a crashed child (doubles)"),
        ("--restart-backoff-max-s", float, "restart delay cap"),
        ("--restart-limit", int, "crashes allowed per child within --restart-window-s"),
        ("--restart-window-s", float, "window for --restart-limit"),
    ]
    for flag, typ, text in specs:
        if flag not in have:
            group.add_argument(flag, type=typ, default=None, help=text)
    if "--exit-on-give-up" not in have:
        group.add_argument(
            "--exit-on-give-up",
            action="store_true",
            default=None,
            help="drain all children and exit 1 when one child crash-loops past the limit",
        )
