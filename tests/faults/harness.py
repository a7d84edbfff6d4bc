"""The fault-injection harness: a real redis-server (AOF on), subprocess workers, producer threads
using ``worker.client.ScoringClient``, a fault schedule, and an invariant checker over the history.

A :class:`Fleet` is one redis-server plus M ``python -m worker serve`` processes on one queue. A
*phase* (:meth:`Fleet.run_phase`) runs N producers that submit jobs with known ids while a fault
function runs in another thread, waits for every answer, and checks the full history:

* every accepted job id (``submit`` returned) has >= 1 result (else *lost*);
* no result carries an id nobody submitted (*unknown*);
* every result is ``ok`` and equal to the in-process scorer's output on the same inputs
  (``worker.executor.StatelessExecutor`` on the same tiny model, or ``NoopScorer``), within
  ``atol`` (else *altered*; error results are counted as *errors*);
* results beyond the first per id are counted as *duplicated* (allowed: at-least-once).

Every result the client's reply reader decodes is recorded, duplicates included, by wrapping the
client's reply buffer (``ScoringClient._buffer.offer``): the client still de-duplicates as usual.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis

from tests.faults.servers import RedisServer
from tests.support.daemon import WorkerProc
from worker import keys
from worker.client import ScoringClient, ScoringTimeout
from worker.protocol import Result

log = logging.getLogger(__name__)

REPORTS: list[dict[str, Any]] = []  # one row per phase; printed by the conftest summary hook


@dataclass(frozen=True)
class Template:
    """One job's sequences and how to score them."""

    seqs: tuple[tuple[tuple[int, ...], int | None, tuple[int, ...] | None], ...]
    temperature: float

    def wire(self) -> list[dict[str, Any]]:
        out = []
        for tokens, prompt_len, mask in self.seqs:
            item: dict[str, Any] = {"tokens": list(tokens)}
            if mask is not None:
                item["mask"] = list(mask)
            else:
                item["prompt_len"] = prompt_len
            out.append(item)
        return out


def make_templates(n: int, vocab: int, seed: int = 7) -> list[Template]:
    """``n`` ragged jobs (1-3 sequences, prompt_len or mask, two temperatures)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        seqs = []
        for _ in range(1 + i % 3):
            length = rng.randint(4, 40)
            tokens = tuple(rng.randrange(vocab) for _ in range(length))
            if rng.random() < 0.3:
                mask = [0] + [rng.randint(0, 1) for _ in range(length - 1)]
                mask[-1] = 1
                seqs.append((tokens, None, tuple(mask)))
            else:
                seqs.append((tokens, rng.randint(1, length - 1), None))
        out.append(Template(tuple(seqs), 1.0 if i % 4 else 0.8))
    return out


def expected_scores(scorer: Any, templates: list[Template]) -> list[list[np.ndarray]]:
    """The in-process scorer's log-probs for every template (mode ``reference``)."""
    from worker.executor import SequenceInput

    out = []
    for t in templates:
        inputs = [SequenceInput(list(tok), pl, list(m) if m else None) for tok, pl, m in t.seqs]
        scores = scorer.score(inputs, mode="reference", temperature=t.temperature).scores
        out.append([np.asarray(s.logps, dtype=np.float64) for s in scores])
    return out


@dataclass
class PhaseReport:
    """Invariants and counts of one phase."""

    scenario: str
    jobs: int
    accepted: int
    lost: int = 0
    duplicated: int = 0
    altered: int = 0
    errors: int = 0
    unknown: int = 0
    time_s: float = 0.0
    faults: list[str] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    def as_row(self) -> dict[str, Any]:
        row = asdict(self)
        row["time_s"] = round(self.time_s, 1)
        return row


class Fleet:
    """A redis-server with AOF plus M subprocess workers serving one queue."""

    def __init__(
        self,
        workdir: Path,
        *,
        workers: int = 2,
        model_dir: str | None = None,
        noop_delay_ms: float | None = None,
        claim_idle_ms: int = 1500,
        max_wait_ms: int = 20,
        appendfsync: str = "always",
        templates: list[Template],
        expected: list[list[np.ndarray]],
        atol: float = 1e-4,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.workdir = Path(workdir)
        self.queue = "faults"
        self.stream = keys.job_streams(self.queue)[0]
        self.server = RedisServer(
            self.workdir / "redis", args=["--appendonly", "yes", "--appendfsync", appendfsync]
        )
        self.n_workers = workers
        self.model_dir = model_dir
        self.noop_delay_ms = noop_delay_ms
        self.claim_idle_ms = claim_idle_ms
        self.max_wait_ms = max_wait_ms
        self.templates = templates
        self.expected = expected
        self.atol = atol
        self.extra_args = extra_args
        self.workers: list[WorkerProc] = []
        self.retired: list[WorkerProc] = []
        self._spawned = 0
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        return self.server.url

    def admin(self) -> redis.Redis:
        return self.server.admin()

    def worker_args(self, name: str) -> list[str]:
        """The ``serve`` flags every worker of the fleet gets."""
        return [
            "--redis-url", self.url, "--queue", self.queue, "--consumer", name,
            "--claim-idle-ms", str(self.claim_idle_ms), "--max-wait-ms", str(self.max_wait_ms),
            "--block-ms", "200", "--metrics-port", "-1", "--max-deliveries", "100",
            "--drain-timeout-s", "60", "--device", "cpu",
        ]  # fmt: skip

    def add_worker(self, name: str, args: list[str]) -> WorkerProc:
        """Start a worker named ``name`` with ``args`` and count it in the fleet."""
        w = WorkerProc(args, self.workdir / f"{name}.log")
        w.name = name  # type: ignore[attr-defined]
        with self.lock:
            self.workers.append(w)
        return w

    def spawn_worker(self) -> WorkerProc:
        """Start one more worker (not waiting for it)."""
        self._spawned += 1
        name = f"w{self._spawned}"
        args = self.worker_args(name)
        if self.noop_delay_ms is not None:
            args += ["--scorer", "noop", "--noop-delay-ms", str(self.noop_delay_ms)]
        else:
            assert self.model_dir is not None
            args += ["--reference-model", self.model_dir]
        args += list(self.extra_args)
        return self.add_worker(name, args)

    def start(self) -> Fleet:
        self.server.start()
        self.ensure_workers()
        return self

    def ensure_workers(self, timeout: float = 180.0) -> None:
        """Replace exited workers and wait until ``n_workers`` serve."""
        with self.lock:
            for w in [w for w in self.workers if w.proc.poll() is not None]:
                self.workers.remove(w)
                self.retired.append(w)
        while len(self.workers) < self.n_workers:
            self.spawn_worker()
        for w in list(self.workers):
            w.wait_ready(timeout)

    def retire(self, w: WorkerProc) -> None:
        with self.lock:
            if w in self.workers:
                self.workers.remove(w)
            self.retired.append(w)

    def alive(self) -> list[WorkerProc]:
        with self.lock:
            return [w for w in self.workers if w.proc.poll() is None]

    def stop(self) -> None:
        for w in self.workers + self.retired:
            w.stop()
        self.server.stop()

    def logs_have_traceback(self) -> list[str]:
        """Names of workers whose log has a traceback (a crash, not a handled fault)."""
        return [
            getattr(w, "name", "?") for w in self.workers + self.retired if "Traceback" in w.log()
        ]

    # ------------------------------------------------------------------ a phase
    def run_phase(
        self,
        scenario: str,
        *,
        producers: int,
        jobs_each: int,
        pace_s: float,
        faults: Callable[[Fleet, threading.Event, list[str]], None] | None = None,
        timeout_s: float = 120.0,
        seed: int = 0,
    ) -> PhaseReport:
        """Submit at least ``producers * jobs_each`` jobs (``pace_s`` apart per producer)
        while ``faults(fleet, done, log)`` runs; wait for results; check the invariants. The
        producers go on submitting until the fault schedule has returned (every planned fault
        done, and whatever it waits for after each), however fast the jobs go, within
        ``timeout_s``: a phase ends on events, never on a guess of how long its jobs take."""
        t0 = time.monotonic()
        known: set[str] = set()
        accepted: set[str] = set()
        history: list[Result] = []
        hist_lock = threading.Lock()
        done = threading.Event()
        fault_log: list[str] = []
        errors: list[BaseException] = []
        rng = random.Random(seed)
        assign = {
            f"{scenario}-p{p}-{k}": rng.randrange(len(self.templates))
            for p in range(producers)
            for k in range(jobs_each)
        }
        faults_over = threading.Event()  # the schedule returned (set at once without one)
        if faults is None:
            faults_over.set()
        submit_until = t0 + timeout_s

        def template_of(job_id: str) -> int:
            with hist_lock:  # jobs past jobs_each draw from their own seeded generator
                if job_id not in assign:
                    assign[job_id] = random.Random(f"{seed}-{job_id}").randrange(
                        len(self.templates)
                    )
                return assign[job_id]

        def produce(p: int) -> None:
            client = ScoringClient(self.url, queue=self.queue, block_ms=300)
            offer = client._buffer.offer

            def recording_offer(result: Result, expected: bool = True) -> bool:
                with hist_lock:
                    history.append(result)
                return offer(result, expected=expected)

            client._buffer.offer = recording_offer  # type: ignore[method-assign]
            mine = []
            try:
                k = 0
                while k < jobs_each or (
                    not faults_over.is_set() and time.monotonic() < submit_until
                ):
                    job_id = f"{scenario}-p{p}-{k}"
                    k += 1
                    tmpl = self.templates[template_of(job_id)]
                    with hist_lock:
                        known.add(job_id)
                    for _attempt in range(100):  # the producer retries with the same id
                        try:
                            client.submit(tmpl.wire(), temperature=tmpl.temperature, job_id=job_id)
                        except redis.RedisError:
                            time.sleep(0.2)
                            continue
                        with hist_lock:
                            accepted.add(job_id)
                        mine.append(job_id)
                        break
                    time.sleep(pace_s)
                deadline = time.monotonic() + timeout_s
                for job_id in mine:
                    with contextlib.suppress(ScoringTimeout):
                        client.raw_result(job_id, max(deadline - time.monotonic(), 0.01))
                time.sleep(0.5)  # let late duplicates arrive before the reader stops
            except BaseException as exc:  # reported by the phase
                errors.append(exc)
            finally:
                client.close()

        threads = [
            threading.Thread(target=produce, args=(p,), daemon=True) for p in range(producers)
        ]
        for t in threads:
            t.start()
        fault_thread = None
        if faults is not None:

            def run_faults() -> None:
                try:
                    faults(self, done, fault_log)
                except BaseException as exc:
                    errors.append(exc)
                finally:
                    faults_over.set()

            fault_thread = threading.Thread(target=run_faults, daemon=True)
            fault_thread.start()
        for t in threads:
            t.join(2 * timeout_s + jobs_each * pace_s + 120)  # submitting, then the results
        done.set()
        if fault_thread is not None:
            fault_thread.join(120)
        if errors:
            raise errors[0]
        report = self.check(scenario, known, accepted, history, time.monotonic() - t0, assign)
        report.faults = fault_log
        REPORTS.append(report.as_row())
        log.info("phase %s: %s", scenario, json.dumps(report.as_row()))
        return report

    def check(
        self,
        scenario: str,
        known: set[str],
        accepted: set[str],
        history: list[Result],
        elapsed: float,
        assign: dict[str, int],
    ) -> PhaseReport:
        """The invariants over the full history of one phase."""
        counts = Counter(r.id for r in history)
        report = PhaseReport(scenario, jobs=len(known), accepted=len(accepted), time_s=elapsed)
        report.lost = len(accepted - set(counts))
        report.unknown = sum(n for job_id, n in counts.items() if job_id not in known)
        report.duplicated = sum(n - 1 for n in counts.values() if n > 1)
        bad: list[str] = []
        for r in history:
            if r.id not in assign:
                continue
            if not r.ok:
                report.errors += 1
                bad.append(f"{r.id}: {r.error}")
                continue
            want = self.expected[assign[r.id]]
            got = [np.asarray(s.logps, dtype=np.float64) for s in r.seqs]
            same = len(got) == len(want) and all(
                g.shape == w.shape and np.allclose(g, w, atol=self.atol, rtol=0)
                for g, w in zip(got, want, strict=False)
            )
            if not same:
                report.altered += 1
                bad.append(f"{r.id}: altered")
        if report.lost:
            report.notes["lost_ids"] = sorted(accepted - set(counts))[:10]
        if bad:
            report.notes["bad"] = bad[:10]
        return report


# ---------------------------------------------------------------------- fault schedules


def kill9_workers(kills: int, every_s: tuple[float, float], seed: int = 1) -> Callable[..., None]:
    """``kill -9`` a random live worker ``kills`` times at random intervals, each replaced at
    once by a new worker (a new consumer name: the dead one's entries must be reclaimed)."""

    def run(fleet: Fleet, done: threading.Event, out: list[str]) -> None:
        rng = random.Random(seed)
        for _ in range(kills):
            if done.wait(rng.uniform(*every_s)):
                return
            alive = fleet.alive()
            if not alive:
                continue
            w = rng.choice(alive)
            w.signal(signal.SIGKILL)
            w.proc.wait(10)
            fleet.retire(w)
            out.append(f"kill -9 {w.name} at {time.strftime('%X')}")  # type: ignore[attr-defined]
            fleet.spawn_worker()

    return run


def sigterm_drain(after_s: float) -> Callable[..., None]:
    """SIGTERM one worker mid-load: it must drain (exit 0); a replacement starts."""

    def run(fleet: Fleet, done: threading.Event, out: list[str]) -> None:
        if done.wait(after_s):
            return
        w = fleet.alive()[0]
        w.signal(signal.SIGTERM)
        rc = w.wait_exit(90)
        fleet.retire(w)
        out.append(f"SIGTERM {w.name}: exit {rc}")  # type: ignore[attr-defined]
        fleet.spawn_worker()

    return run


def redis_restart(times: int, after_s: float, down_s: float) -> Callable[..., None]:
    """``kill -9`` redis-server mid-load and restart it on the same AOF; record which entries
    were pending at the kill and check they are all still in the stream after the restart.
    ``CLIENT PAUSE ... WRITE`` holds every client's writes from the snapshot to the kill: a worker
    acks and trims (``XTRIM MINID``) entries as it answers them, so without the pause an entry
    pending at the snapshot may be answered and trimmed before the kill, and read as lost."""

    def run(fleet: Fleet, done: threading.Event, out: list[str]) -> None:
        for _ in range(times):
            if done.wait(after_s):
                return
            admin = fleet.admin()
            try:
                admin.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")  # reads still answer
                pending = admin.xpending_range(fleet.stream, "scoring", "-", "+", 10000)
            except redis.RedisError:
                pending = []
            ids = [p["message_id"] for p in pending]
            length = admin.xlen(fleet.stream)
            fleet.server.restart(signal.SIGKILL, down_s=down_s)
            admin = fleet.admin()
            missing = [i for i in ids if not admin.xrange(fleet.stream, i, i)]
            after = admin.xlen(fleet.stream)
            groups = [g["name"] for g in admin.xinfo_groups(fleet.stream)]
            out.append(
                f"redis kill -9 + restart: {len(ids)} pending before, {len(missing)} missing "
                f"after; xlen {length} -> {after}; groups {groups}"
            )
            assert not missing, f"pending entries lost by the restart: {missing[:5]}"
            assert after >= length and b"scoring" in groups

    return run


def client_kill(times: int, every_s: float) -> Callable[..., None]:
    """``CLIENT KILL TYPE normal`` (every worker and producer connection) periodically."""

    def run(fleet: Fleet, done: threading.Event, out: list[str]) -> None:
        for _ in range(times):
            if done.wait(every_s):
                return
            killed = fleet.admin().execute_command(
                "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"
            )
            out.append(f"CLIENT KILL TYPE normal: {killed} connections")

    return run


def sigstop(after_s: float, stopped_s: float) -> Callable[..., None]:
    """SIGSTOP one worker for longer than the claim idle time, then SIGCONT it."""

    def run(fleet: Fleet, done: threading.Event, out: list[str]) -> None:
        if done.wait(after_s):
            return
        w = fleet.alive()[0]
        name = w.name  # type: ignore[attr-defined]
        w.signal(signal.SIGSTOP)
        # Entries delivered to the stopped worker (a blocked XREADGROUP is still served) stay in
        # its pending list until the others reclaim them past the claim idle time.
        admin = fleet.admin()
        held = 0
        end = time.monotonic() + stopped_s
        while time.monotonic() < end:
            pel = admin.xpending_range(fleet.stream, "scoring", "-", "+", 10000, consumername=name)
            held = max(held, len(pel))
            time.sleep(0.1)
        w.signal(signal.SIGCONT)
        out.append(f"SIGSTOP {name} for {stopped_s}s (held up to {held} entries), then SIGCONT")

    return run
