"""The one launcher of local worker processes: ``python -m worker serve ...`` (or another
subcommand) started on this host by the demo, the tests, the benchmarks and the checks.

* :func:`free_port`: a port for a server or a worker's metrics;
* :func:`worker_command`: the argv, with this interpreter;
* :class:`LocalWorker`: one started process, its output in a file (or wherever ``stdout`` says),
  waited for by a log line, stopped with SIGTERM (it drains) then SIGKILL, or killed outright;
* :func:`wait_readers`: wait until named consumers are in their read loop (``CLIENT LIST``);
* :func:`stop_all`: SIGTERM several at once, then SIGKILL what outlives the grace period.

Nothing here reads the queue: the Redis client of :func:`wait_readers` is the caller's.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

READY_LINE = r"serving .* \(group "
"""The line a worker logs once it reads its queue (``daemon.worker``)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (whoever binds it next had better be quick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def worker_command(
    args: Sequence[str], *, command: str = "serve", log_level: str | None = None
) -> list[str]:
    """``python -m worker [--log-level L] <command> *args`` with this interpreter."""
    level = ["--log-level", log_level] if log_level else []
    return [sys.executable, "-m", "worker", *level, command, *args]


class LocalWorker:
    """A ``python -m worker <command>`` process on this host.

    ``log_path``: its stdout and stderr go to that file (``append`` adds to it); without one,
    ``popen`` says where they go (``stdout=subprocess.DEVNULL``, say), else they are inherited.
    ``env``: variables set on top of this process's environment. Other keywords go to
    ``subprocess.Popen`` as they are (``cwd``, ``stdin``, ``preexec_fn``...).
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        log_path: Path | None = None,
        append: bool = False,
        command: str = "serve",
        log_level: str | None = None,
        env: Mapping[str, str] | None = None,
        **popen: Any,
    ) -> None:
        self.log_path = log_path
        self._log: IO[bytes] | None = None
        if log_path is not None:
            self._log = open(log_path, "ab" if append else "wb")  # noqa: SIM115 - closed by stop
            popen.setdefault("stdout", self._log)
            popen.setdefault("stderr", subprocess.STDOUT)
        if env is not None:
            popen["env"] = {**os.environ, **env}
        self.argv = worker_command(args, command=command, log_level=log_level)
        self.proc: subprocess.Popen[bytes] = subprocess.Popen(self.argv, **popen)

    @property
    def pid(self) -> int:
        """The process id."""
        return self.proc.pid

    def poll(self) -> int | None:
        """Its exit code, or ``None`` while it runs."""
        return self.proc.poll()

    def log(self) -> str:
        """Everything it wrote to ``log_path`` so far."""
        if self.log_path is None:
            raise ValueError("this worker has no log file")
        return self.log_path.read_text(errors="replace")

    def wait_log(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        """Wait for a log line matching ``pattern``; ``RuntimeError`` (with the log) if the
        process exits first, ``TimeoutError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.log())
            if m is not None:
                return m
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited ({self.proc.returncode}):\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for log {pattern!r}")
            time.sleep(0.05)

    def wait_ready(self, timeout: float = 90.0) -> LocalWorker:
        """Wait until the worker logged that it serves (:data:`READY_LINE`)."""
        self.wait_log(READY_LINE, timeout)
        return self

    @property
    def metrics_url(self) -> str:
        """The bound metrics URL (from the log line)."""
        return self.wait_log(r"metrics on (http://[\d.]+:\d+/metrics)", 30).group(1)

    def signal(self, sig: int) -> None:
        """Send a signal."""
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = 30.0) -> int:
        """Wait for the process to exit; returns its code."""
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL if still running, and close the log."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._close()

    def stop(self, grace_s: float = 30.0) -> int:
        """SIGTERM (the worker drains), SIGKILL if it still runs ``grace_s`` later; close the
        log. Returns the exit code."""
        stop_all([self], grace_s)
        return self.proc.returncode

    def _close(self) -> None:
        if self._log is not None:
            self._log.close()


def wait_readers(
    client: Any,
    names: Iterable[str],
    procs: Sequence[subprocess.Popen[bytes]],
    timeout_s: float,
) -> None:
    """Wait until every worker consumer in ``names`` is in its read loop: a connection named
    after it (``scoring-worker:<name>``) ran XREADGROUP (``client``: a ``redis.Redis``). XINFO
    CONSUMERS is no use here: Redis 7.0 registers a consumer only once it is delivered to.

    Raises ``RuntimeError`` when a worker exits first, ``TimeoutError`` after ``timeout_s``.
    """
    want = {f"scoring-worker:{n}" for n in names}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a worker exited with {p.returncode} before it read")
        if want <= {c.get("name") for c in client.client_list() if c.get("cmd") == "xreadgroup"}:
            return
        time.sleep(0.05)
    raise TimeoutError(f"workers did not start reading within {timeout_s:g}s")


def stop_all(
    workers: Iterable[subprocess.Popen[bytes] | LocalWorker], grace_s: float = 30.0
) -> None:
    """SIGTERM every running worker (each drains its batch), then wait for each; one still
    running ``grace_s`` after its SIGTERM is killed. A :class:`LocalWorker`'s log is closed."""
    workers = list(workers)
    procs = [w.proc if isinstance(w, LocalWorker) else w for w in workers]
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for w in workers:
        if isinstance(w, LocalWorker):
            w._close()


__all__ = [
    "READY_LINE",
    "LocalWorker",
    "free_port",
    "stop_all",
    "wait_readers",
    "worker_command",
]
