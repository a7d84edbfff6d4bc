"""The drain measurement: how long a stopping worker takes to exit, and how long the jobs it read
but never started wait, with the hand-back and without (``--no-handback``).

Two no-op workers with a slow batch (``--noop-delay-ms``) and a small token budget (a few jobs a
batch) serve one queue. A burst of jobs lands in one ``MULTI``, so the first worker to wake reads
nearly all of them (its read-ahead backlog); that worker gets SIGTERM while its first batch
computes, and SIGKILL once ``grace_s`` passed (what Kubernetes does at
``terminationGracePeriodSeconds``). Every result's arrival time and answering worker are recorded.
"""

from __future__ import annotations

import signal
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from tests.faults.harness import Fleet
from worker import keys
from worker.protocol import decode_result, encode_job

#: Every job: one sequence of this many tokens (a batch of ``JOB_TOKENS * 2`` holds two jobs).
JOB_TOKENS = 30


@dataclass
class DrainReport:
    """What one drain measurement saw (times in s from the SIGTERM)."""

    mode: str
    jobs: int
    held: int = 0  # entries the stopped worker held at its SIGTERM
    exit_s: float = 0.0
    killed: bool = False  # still running at grace_s: SIGKILLed
    exit_code: int | None = None
    batch_s: float = 0.0  # the longest batch any worker reported (compute_ms)
    answered_by_other: int = 0  # of the held entries, how many the other worker answered
    pickup_s: float | None = None  # first answer by the other worker of a held entry
    last_s: float | None = None  # last answer of a held entry
    lost: int = 0
    duplicated: int = 0
    notes: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        """One printable line."""

        def fmt(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"

        return (
            f"{self.mode:<12} jobs {self.jobs} held {self.held} exit {fmt(self.exit_s)} s"
            f"{' (SIGKILL at grace)' if self.killed else ''} batch {fmt(self.batch_s)} s; held "
            f"jobs answered by the other worker {self.answered_by_other}, first after "
            f"{fmt(self.pickup_s)} s, last after {fmt(self.last_s)} s; lost {self.lost}, "
            f"duplicated {self.duplicated}"
        )


def measure_drain(
    fleet: Fleet, *, mode: str, jobs: int, grace_s: float, timeout_s: float = 120.0
) -> DrainReport:
    """Burst ``jobs`` onto the fleet's queue, SIGTERM the worker holding most of them, SIGKILL it
    at ``grace_s``, collect every result; the fleet's workers must be serving and idle."""
    admin = fleet.admin()
    reply_to = keys.reply_stream(fleet.stream, f"drain-{mode}")
    pipe = admin.pipeline(transaction=True)
    job_ids = [f"{mode}-{k}" for k in range(jobs)]
    for k, job_id in enumerate(job_ids):
        tokens = [(k * 7 + i) % 97 + 1 for i in range(JOB_TOKENS)]
        payload = encode_job(job_id, "reference", reply_to, [{"tokens": tokens, "prompt_len": 1}])
        pipe.xadd(fleet.stream, {"payload": payload})
    entry_of = {
        (e.decode() if isinstance(e, bytes) else str(e)): j
        for e, j in zip(pipe.execute(), job_ids, strict=True)
    }
    report = DrainReport(mode, jobs)
    # The worker that read the burst: it holds (nearly) all of it once its first batch started.
    deadline = time.monotonic() + 30
    holder, held_ids = None, []
    while time.monotonic() < deadline:
        for w in fleet.alive():
            name = w.name  # type: ignore[attr-defined]
            rows = admin.xpending_range(fleet.stream, "scoring", "-", "+", 10000, consumername=name)
            if len(rows) >= jobs // 2:
                holder, held_ids = w, [r["message_id"].decode() for r in rows]
        if holder is not None:
            break
        time.sleep(0.01)
    assert holder is not None, "no worker read the burst"
    time.sleep(0.05)  # inside its first batch
    t0 = time.monotonic()
    holder.signal(signal.SIGTERM)
    report.held = len(held_ids)
    results: dict[str, list[tuple[float, Any]]] = {}
    last = "0-0"

    def read(block_ms: int) -> None:
        nonlocal last
        reply = admin.xread({reply_to: last}, count=1000, block=block_ms)
        now = time.monotonic() - t0
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                last = entry_id.decode()
                res = decode_result(fields[b"payload"])
                results.setdefault(res.id, []).append((now, res))

    while holder.proc.poll() is None:
        if time.monotonic() - t0 > grace_s:
            holder.signal(signal.SIGKILL)
            report.killed = True
            holder.proc.wait(10)
            break
        read(20)
    report.exit_s = time.monotonic() - t0
    report.exit_code = holder.proc.returncode
    fleet.retire(holder)
    end = time.monotonic() + timeout_s
    while len(results) < jobs and time.monotonic() < end:
        read(200)
    read(300)  # late duplicates
    report.lost = jobs - len(results)
    report.duplicated = sum(len(v) - 1 for v in results.values())
    compute = [r.info.get("compute_ms", 0.0) for v in results.values() for _, r in v]
    report.batch_s = max(compute, default=0.0) / 1000.0
    holder_name = holder.name  # type: ignore[attr-defined]
    other_times = [
        at
        for entry_id in held_ids
        for at, r in results.get(entry_of.get(entry_id, ""), [])[:1]
        if r.info.get("worker") != holder_name
    ]
    held_times = [at for e in held_ids for at, _ in results.get(entry_of.get(e, ""), [])[:1]]
    report.answered_by_other = len(other_times)
    report.pickup_s = min(other_times, default=None)
    report.last_s = max(held_times, default=None)
    if other_times:
        report.notes["median_other_s"] = round(statistics.median(other_times), 2)
    return report


__all__ = ["JOB_TOKENS", "DrainReport", "measure_drain"]
