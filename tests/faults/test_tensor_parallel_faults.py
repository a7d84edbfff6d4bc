"""Fault scenarios of a tensor-parallel worker: ``serve --replicas 1 --tensor-parallel 2`` (one
group of two gloo ranks under the supervisor) against a real redis-server while producers
submit. kill -9 of the follower rank mid-load: the leader takes the group down (the batch in
flight is never acked), the supervisor starts a new group, the entries are reclaimed; stopping
the follower (SIGSTOP) does the same through the heartbeats. SIGTERM drains the whole group.
Every phase: nothing lost, nothing altered (the in-process one-process executor's log-probs).

Quick variant (inside ``make test``): one kill -9, a few dozen jobs. Full (``make test-faults``):
more kills, more jobs, and the SIGSTOP scenario.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.faults import harness
from tests.faults.harness import Fleet, PhaseReport
from tests.faults.servers import have_redis_server
from tests.support.daemon import WorkerProc

pytestmark = [
    pytest.mark.faults,
    pytest.mark.slow,
    pytest.mark.redis,
    pytest.mark.skipif(not have_redis_server(), reason="needs redis-server"),
]

FOLLOWER = re.compile(r"rank 1 of 2 started: pid (\d+)")
JOINED = "tensor-parallel group of 2 joined"
SERVING = re.compile(r"worker \S+ serving .* \(group ")


class GroupFleet(Fleet):
    """A ``Fleet`` whose one worker is a supervised tensor-parallel group of two ranks."""

    def spawn_worker(self) -> WorkerProc:
        self._spawned += 1
        name = f"g{self._spawned}"
        args = self.worker_args(name)
        args += ["--reference-model", str(self.model_dir), "--replicas", "1"]
        args += ["--tensor-parallel", "2", "--restart-backoff-s", "0.5"]
        return self.add_worker(name, args)


def follower_pid(w: WorkerProc) -> int:
    """The pid of the group's current follower rank (the last one the leader started)."""
    return int(FOLLOWER.findall(w.log())[-1])


def fault_follower(sig: int, times: int, every_s: float, first_s: float) -> Callable[..., None]:
    """Send ``sig`` to the follower rank of the one group ``times`` times: the first after
    ``first_s``, each later one ``every_s`` after the supervisor's new group serves again (so
    every signal lands while batches run, not while a group loads)."""

    def run(fleet: Fleet, done: threading.Event, out: list[str]) -> None:
        (w,) = fleet.alive()
        served = len(SERVING.findall(w.log()))
        for i in range(times):
            if done.wait(first_s if i == 0 else every_s):
                return
            pid = follower_pid(w)
            os.kill(pid, sig)
            out.append(f"{signal.Signals(sig).name} follower pid {pid} at {time.strftime('%X')}")
            deadline = time.monotonic() + 120
            while len(SERVING.findall(w.log())) < served + i + 1 and time.monotonic() < deadline:
                time.sleep(0.2)  # the supervisor's new group

    return run


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GroupFleet]:
    from tests.support.models import VOCAB, tiny_causal
    from worker.executor import ExecutorConfig, StatelessExecutor

    model_dir = tmp_path_factory.mktemp("tp-fault-model")
    tiny_causal("llama", seed=0).save_pretrained(model_dir)
    templates = harness.make_templates(24, VOCAB)
    one = StatelessExecutor.from_pretrained(
        ExecutorConfig(mode="reference", device="cpu"), reference_model=str(model_dir)
    )
    f = GroupFleet(
        tmp_path_factory.mktemp("tp-fleet"),
        workers=1,
        model_dir=str(model_dir),
        claim_idle_ms=1500,
        templates=templates,
        expected=harness.expected_scores(one, templates),
        atol=1e-5,
    )
    try:
        yield f.start()
    finally:
        f.stop()


def _assert_held(report: PhaseReport) -> None:
    assert report.accepted == report.jobs, report
    assert (report.lost, report.altered, report.errors, report.unknown) == (0, 0, 0, 0), report


@pytest.mark.timeout(600)
def test_kill9_of_the_follower_rank_restarts_the_group(
    fleet: GroupFleet, faults_full: bool
) -> None:
    kills = 3 if faults_full else 1
    fleet.ensure_workers()
    (w,) = fleet.workers
    before = w.log().count(JOINED)
    report = fleet.run_phase(
        "tp-kill-9-follower",
        producers=2,
        jobs_each=120 if faults_full else 30,
        pace_s=0.1,
        faults=fault_follower(signal.SIGKILL, kills, every_s=1.0, first_s=1.0),
        timeout_s=240,
    )
    _assert_held(report)
    assert len(report.faults) == kills
    log = w.log()
    # each kill is a group fault, seen by the leader's watch ("rank 1 closed its channel") or,
    # when the kill lands inside a collective, by the leader itself (gloo's "Connection closed
    # by peer" from a collective of its own, a call's broadcast or one inside the forward),
    # whichever comes first
    faults = re.findall(r"tensor-parallel group fault: (rank (?:1 |0: ).*)", log)
    downs = [line for line in log.splitlines() if "group fault" in line or "exit 75" in line]
    assert len(faults) >= kills, "\n".join(downs)
    assert log.count(JOINED) >= before + kills  # a new group after each kill
    assert w.proc.poll() is None  # the supervisor serves on


@pytest.mark.timeout(600)
def test_a_stopped_follower_takes_the_group_down(fleet: GroupFleet, faults_full: bool) -> None:
    if not faults_full:
        pytest.skip("full variant only (make test-faults): the heartbeat timeout is 10 s")
    fleet.ensure_workers()
    report = fleet.run_phase(
        "tp-sigstop-follower",
        producers=2,
        jobs_each=60,
        pace_s=0.1,
        faults=fault_follower(signal.SIGSTOP, 1, every_s=1.0, first_s=1.0),
        timeout_s=240,
    )
    _assert_held(report)
    assert "sent no heartbeat" in fleet.workers[0].log()


@pytest.mark.timeout(600)
def test_sigterm_drains_the_group(fleet: GroupFleet, tmp_path: Path) -> None:
    fleet.ensure_workers()
    (w,) = fleet.workers
    report = fleet.run_phase(
        "tp-sigterm-drain",
        producers=2,
        jobs_each=20,
        pace_s=0.05,
        faults=harness.sigterm_drain(after_s=1.0),
        timeout_s=240,
    )
    _assert_held(report)
    assert report.faults and report.faults[0].endswith("exit 0"), report.faults
    assert "rank 1 stopped (exit 0)" in w.log()
