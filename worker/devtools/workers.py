"""Worker processes that a dev tool starts on this host (benchmarks, the autoscaling check):
wait until every one of them reads its queue, and stop them all (SIGTERM, so each drains;
SIGKILL for one still running after the grace period)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterable, Sequence

import redis


def wait_readers(
    client: redis.Redis,
    names: Iterable[str],
    procs: Sequence[subprocess.Popen[bytes]],
    timeout_s: float,
) -> None:
    """Wait until every worker consumer in ``names`` is in its read loop: a connection named
    after it (``scoring-worker:<name>``) ran XREADGROUP. XINFO CONSUMERS is no use here: Redis
    7.0 registers a consumer only once it is delivered to.

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


def stop_all(procs: Iterable[subprocess.Popen[bytes]], grace_s: float = 30.0) -> None:
    """SIGTERM every running worker (each drains its batch), then wait for each; one still
    running ``grace_s`` after its SIGTERM is killed."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
