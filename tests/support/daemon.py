"""Helpers for the daemon tests: subprocess workers, enqueueing raw jobs, collecting results.

Plain functions and classes (not fixtures) so ``tests/conftest.py`` stays the only conftest.
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from worker import keys
from worker.processes.local import LocalWorker, worker_command
from worker.protocol import Result, decode_result, encode_job

ROOT = Path(__file__).resolve().parents[2]


def wait_until(
    pred: Callable[[], Any], timeout: float, interval: float = 0.05, what: str = ""
) -> Any:
    """Poll ``pred`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or pred}")
        time.sleep(interval)


@contextmanager
def thread_worker(
    redis_url: str, queue: str, executor: Any, **config: Any
) -> Iterator[tuple[Any, Any]]:
    """A ``Worker`` for ``executor`` on ``queue`` in a thread of this process, with its own
    metrics registry: yields ``(worker, registry)``, stops it after. ``config`` overrides
    ``WorkerConfig`` fields (short polls by default). Producers should pass
    ``wait_for_unknown_queue=True``: the worker creates its group as it starts."""
    from prometheus_client import CollectorRegistry

    from worker.config import RedisSettings
    from worker.daemon import Worker
    from worker.daemon.config import WorkerConfig
    from worker.observability.metrics import WorkerMetrics

    settings: dict[str, Any] = {
        "streams": tuple(keys.job_streams(queue, 1)), "consumer": f"c{uuid.uuid4().hex[:6]}",
        "metrics_port": None, "block_ms": 50, "claim_idle_ms": 5000, "max_wait_ms": 50,
    }  # fmt: skip
    registry = CollectorRegistry()
    worker = Worker(
        WorkerConfig(**{**settings, **config}), RedisSettings(url=redis_url), executor,
        metrics=WorkerMetrics(registry),
    )  # fmt: skip
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield worker, registry
    finally:
        worker.request_stop()
        thread.join(30)


class WorkerProc(LocalWorker):
    """A ``python -m worker serve`` subprocess (the package's launcher) with its log in a file,
    run from the repository root, unbuffered."""

    def __init__(self, args: Iterable[str], log_path: Path, env: dict[str, str] | None = None):
        env = {"PYTHONUNBUFFERED": "1", **(env or {})}
        super().__init__(list(args), log_path=log_path, env=env, cwd=ROOT)

    def stop(self, grace_s: float = 30.0) -> int:
        """Kill if still running and close the log (tests never wait for a drain here)."""
        self.kill()
        return self.proc.returncode


def start_demo(args: list[str], **popen: Any) -> tuple[subprocess.Popen[str], str]:
    """``python -m worker demo *args`` (text pipes, from the repository root) read until it
    waits for Ctrl-C: the process and what it printed so far."""
    proc = subprocess.Popen(
        worker_command(args, command="demo"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        **popen,
    )
    assert proc.stdout is not None
    out = ""
    deadline = time.monotonic() + 240
    while "press Ctrl-C" not in out and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        out += line
    assert "press Ctrl-C" in out, out + (proc.stderr.read() if proc.stderr else "")
    return proc, out


def metric(url: str, name: str, labels: str = "") -> float:
    """One sample value from a Prometheus text endpoint (0.0 when absent)."""
    import urllib.request

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    pat = re.compile(rf"^{re.escape(name)}{re.escape(labels)}\s+([0-9.e+-]+)$", re.M)
    m = pat.search(text)
    return float(m.group(1)) if m else 0.0


def enqueue(
    client: redis.Redis,
    stream: str,
    job_id: str,
    reply_to: str,
    seqs: list[dict[str, Any]],
    mode: str = "reference",
    **kwargs: Any,
) -> str:
    """XADD one encoded job; returns the entry id."""
    payload = encode_job(job_id, mode, reply_to, seqs, **kwargs)
    return client.xadd(stream, {"payload": payload}).decode()


def add_dead_letter(
    client: Any, job_stream: str, job_id: str, reason: str = "max_deliveries: test"
) -> str:
    """A dead letter as the daemon writes it (same fields), for the job ``job_id``."""
    payload = encode_job(
        job_id,
        "reference",
        keys.reply_stream(job_stream, "c"),
        [{"tokens": [1, 2], "prompt_len": 1}],
    )
    fields = {"payload": payload, "reason": reason, "stream": job_stream, "id": "1-0",
              "deliveries": 6, "consumer": "gpu-0", "at_ms": int(time.time() * 1000)}  # fmt: skip
    return client.xadd(keys.dead_letter_stream(job_stream), fields).decode()


def collect(
    client: redis.Redis, reply_to: str, ids: Iterable[str], timeout: float = 60.0
) -> tuple[dict[str, Result], int]:
    """Read ``reply_to`` until every id in ``ids`` has a result; returns (first result per id,
    number of duplicate results seen)."""
    wanted = set(ids)
    got: dict[str, Result] = {}
    dups = 0
    last = "0-0"
    deadline = time.monotonic() + timeout
    while not wanted <= set(got):
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            missing = sorted(wanted - set(got))
            raise AssertionError(f"no result for {len(missing)} jobs, e.g. {missing[:5]}")
        reply = client.xread({reply_to: last}, count=1000, block=min(left_ms, 500))
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                last = entry_id.decode()
                res = decode_result(fields[b"payload"])
                if res.id in got:
                    dups += 1
                else:
                    got[res.id] = res
    return got, dups


def pending_of(client: redis.Redis, stream: str, group: str, consumer: str | None = None) -> int:
    """Pending entries of the group (of one consumer when given)."""
    if consumer is None:
        return int(client.xpending(stream, group)["pending"])
    return len(client.xpending_range(stream, group, "-", "+", 10000, consumername=consumer))


def kill9_reclaim_scenario(url: str, queue: str, tmp_path: Path, jobs: int) -> None:
    """A noop worker with a 30 s batch holds entries and is killed with ``kill -9``; a second
    worker (``--claim-idle-ms 800``) must reclaim and answer every job, once, and ack them all."""
    group = keys.DEFAULT_GROUP
    client = redis.Redis.from_url(url)
    stream = keys.job_streams(queue)[0]
    reply = keys.reply_stream(stream, "c")

    def args(consumer: str, *extra: str) -> list[str]:
        return [
            "--redis-url", url, "--queue", queue, "--consumer", consumer, "--scorer", "noop",
            "--metrics-port", "0", "--claim-idle-ms", "800", *extra,
        ]  # fmt: skip

    slow = WorkerProc(args("slow", "--noop-delay-ms", "30000"), tmp_path / "slow.log")
    fast = None
    try:
        slow.wait_ready()
        ids = [f"k{i}" for i in range(jobs)]
        for job_id in ids:
            enqueue(client, stream, job_id, reply, [{"tokens": [1, 2, 3, 4], "prompt_len": 2}])
        wait_until(lambda: pending_of(client, stream, group, "slow") > 0, 20, what="slow reads")
        held = pending_of(client, stream, group, "slow")
        slow.signal(signal.SIGKILL)
        slow.wait_exit(10)
        fast = WorkerProc(args("fast"), tmp_path / "fast.log")
        results, dups = collect(client, reply, ids, timeout=60)
        assert all(r.ok for r in results.values())
        assert {r.info["worker"] for r in results.values()} == {"fast"}
        assert dups == 0  # the killed worker never wrote anything
        assert metric(fast.metrics_url, "scoring_entries_reclaimed_total") >= held
        wait_until(lambda: pending_of(client, stream, group) == 0, 10, what="acks")
        assert "Traceback" not in fast.log()
    finally:
        slow.stop()
        if fast is not None:
            fast.stop()
