"""Fault-injection scenarios: producers and subprocess workers against a real redis-server (AOF,
``appendfsync always``) while workers are killed, stopped, drained, connections are killed and
Redis restarts. Each phase checks: nothing lost, nothing altered, no unknown ids; duplicates are
counted (at-least-once) and reported in the session summary.

Quick variant (inside ``make test``): one fleet of 2 tiny-Llama workers shared by the phases, a few
dozen jobs per phase. Full variant: ``make test-faults`` (``--faults-full``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults import harness
from tests.faults.harness import Fleet, PhaseReport
from tests.faults.servers import have_redis_server

pytestmark = [
    pytest.mark.faults,
    pytest.mark.slow,
    pytest.mark.redis,
    pytest.mark.skipif(not have_redis_server(), reason="needs redis-server"),
]

N_TEMPLATES = 24


@pytest.fixture(scope="module")
def model_and_expected(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[str, list[harness.Template], list]:
    """A tiny Llama saved to disk, job templates, and the in-process executor's scores."""
    from tests.support.models import VOCAB, tiny_causal
    from worker.executor import ExecutorConfig, StatelessExecutor

    model_dir = tmp_path_factory.mktemp("fault-model")
    tiny_causal("llama", seed=0).save_pretrained(model_dir)
    templates = harness.make_templates(N_TEMPLATES, VOCAB)
    executor = StatelessExecutor.from_pretrained(
        ExecutorConfig(mode="reference", device="cpu"), reference_model=str(model_dir)
    )
    return str(model_dir), templates, harness.expected_scores(executor, templates)


@pytest.fixture(scope="module")
def fleet(
    model_and_expected: tuple[str, list[harness.Template], list],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    model_dir, templates, expected = model_and_expected
    f = Fleet(
        tmp_path_factory.mktemp("fleet"),
        workers=2,
        model_dir=model_dir,
        claim_idle_ms=1500,
        templates=templates,
        expected=expected,
    )
    try:
        yield f.start()
    finally:
        f.stop()


def _size(full: bool, quick: tuple[int, int, float], big: tuple[int, int, float]) -> dict:
    producers, jobs_each, pace_s = big if full else quick
    return {"producers": producers, "jobs_each": jobs_each, "pace_s": pace_s}


def _assert_held(report: PhaseReport) -> None:
    assert report.accepted == report.jobs, report
    assert report.lost == 0, report
    assert report.altered == 0, report
    assert report.errors == 0, report
    assert report.unknown == 0, report


@pytest.mark.timeout(600)
def test_client_connections_killed(fleet: Fleet, faults_full: bool) -> None:
    fleet.ensure_workers()
    report = fleet.run_phase(
        "client-kill",
        **_size(faults_full, (2, 40, 0.1), (3, 400, 0.03)),
        faults=harness.client_kill(times=10 if faults_full else 3, every_s=1.2),
    )
    _assert_held(report)
    assert len(report.faults) >= 1


@pytest.mark.timeout(600)
def test_worker_sigstopped_past_claim_idle_then_resumed(fleet: Fleet, faults_full: bool) -> None:
    fleet.ensure_workers()
    report = fleet.run_phase(
        "sigstop",
        **_size(faults_full, (2, 40, 0.1), (3, 300, 0.03)),
        faults=harness.sigstop(after_s=0.8, stopped_s=3 * fleet.claim_idle_ms / 1000),
    )
    _assert_held(report)
    assert all(w.proc.poll() is None for w in fleet.workers)  # the resumed worker serves on
    assert len(report.faults) == 1


@pytest.mark.timeout(600)
def test_redis_restart_with_aof_always(fleet: Fleet, faults_full: bool) -> None:
    fleet.ensure_workers()
    report = fleet.run_phase(
        "redis-restart-aof",
        **_size(faults_full, (2, 40, 0.1), (3, 400, 0.03)),
        faults=harness.redis_restart(
            times=3 if faults_full else 1, after_s=4.0 if faults_full else 1.5, down_s=1.0
        ),
    )
    _assert_held(report)
    assert report.faults, "the restart did not happen inside the phase"


@pytest.mark.timeout(600)
def test_workers_kill9_at_random_points(fleet: Fleet, faults_full: bool) -> None:
    fleet.ensure_workers()
    kills = 8 if faults_full else 2
    # The kill schedule (at most kills x 2 s) fits inside the submission window (full: 500 jobs
    # x 0.04 s = 20 s; quick: 50 x 0.1 s = 5 s), so every kill lands while jobs are in flight
    # however fast this machine drains them.
    report = fleet.run_phase(
        "kill-9-workers",
        **_size(faults_full, (2, 50, 0.1), (3, 500, 0.04)),
        faults=harness.kill9_workers(kills, every_s=(1.0, 2.0)),
        timeout_s=240,
    )
    _assert_held(report)
    assert len(report.faults) == kills


@pytest.mark.timeout(600)
def test_sigterm_drains_then_replacement(fleet: Fleet, faults_full: bool) -> None:
    fleet.ensure_workers()
    report = fleet.run_phase(
        "sigterm-drain",
        **_size(faults_full, (2, 40, 0.1), (3, 300, 0.03)),
        faults=harness.sigterm_drain(after_s=3.0 if faults_full else 1.0),
    )
    _assert_held(report)
    assert report.faults and report.faults[0].endswith("exit 0"), report.faults


@pytest.mark.timeout(600)
def test_slow_batch_longer_than_claim_idle(
    tmp_path: Path, faults_full: bool, model_and_expected: tuple
) -> None:
    """A noop worker whose every batch takes 2.5x the claim idle time: its leases are renewed,
    so a second worker never steals the entries (no duplicates) and nothing is lost."""
    from worker.scorer.noop import NoopScorer

    _, templates, _ = model_and_expected
    fleet = Fleet(
        tmp_path,
        workers=2,
        noop_delay_ms=2500,
        claim_idle_ms=1000,
        max_wait_ms=200,
        templates=templates,
        expected=harness.expected_scores(NoopScorer(), templates),
    )
    try:
        fleet.start()
        report = fleet.run_phase(
            "slow-batch", **_size(faults_full, (2, 8, 0.3), (2, 40, 0.2)), timeout_s=180
        )
    finally:
        fleet.stop()
    _assert_held(report)
    assert report.duplicated == 0, report


def _drain_fleet(tmp_path: Path, *, handback: bool, delay_ms: int, claim_idle_ms: int) -> Fleet:
    from tests.faults.drain import JOB_TOKENS

    extra = ("--max-batch-tokens", str(2 * JOB_TOKENS), "--block-ms", "100")
    return Fleet(
        tmp_path / ("handback" if handback else "no-handback"),
        workers=2,
        noop_delay_ms=delay_ms,
        claim_idle_ms=claim_idle_ms,
        max_wait_ms=5,
        templates=[],
        expected=[],
        extra_args=extra + (() if handback else ("--no-handback",)),
    )


@pytest.mark.timeout(600)
def test_sigterm_hands_back_unstarted_jobs(tmp_path: Path, faults_full: bool) -> None:
    """SIGTERM a worker holding a burst of jobs (two jobs a batch), SIGKILL it at a grace period
    shorter than draining the whole burst, with the hand-back and without (``--no-handback``):
    with it the worker exits within one batch time + 2 s and the other worker answers the
    handed-back jobs at once, far before the claim idle time; nothing is lost either way."""
    from tests.faults.drain import measure_drain

    jobs, delay_ms = (60, 400) if faults_full else (32, 300)
    claim_idle_ms, grace_s = 8000, 3.0
    reports = {}
    for handback in (False, True):
        fleet = _drain_fleet(
            tmp_path, handback=handback, delay_ms=delay_ms, claim_idle_ms=claim_idle_ms
        )
        try:
            fleet.start()
            mode = "handback" if handback else "no-handback"
            reports[mode] = report = measure_drain(fleet, mode=mode, jobs=jobs, grace_s=grace_s)
            harness.REPORTS.append({
                "scenario": f"sigterm-{mode}", "jobs": jobs, "lost": report.lost,
                "duplicated": report.duplicated, "altered": 0, "errors": 0, "unknown": 0,
                "time_s": round(report.last_s or 0.0, 1), "faults": [report.line()],
            })  # fmt: skip
            assert not fleet.logs_have_traceback()
        finally:
            fleet.stop()
    for r in reports.values():
        print(r.line())
    before, after = reports["no-handback"], reports["handback"]
    assert before.lost == 0 and after.lost == 0, (before, after)
    # With the hand-back: out within one batch + 2 s, cleanly, and the jobs it held are taken by
    # the other worker well before the claim idle time (they did not wait for their leases).
    assert not after.killed and after.exit_code == 0, after
    assert after.exit_s <= after.batch_s + 2.0, after
    assert after.answered_by_other >= after.held - 4, after  # all but the in-flight batch
    assert after.pickup_s is not None and after.pickup_s < claim_idle_ms / 1000 / 2, after
    # Without: the whole backlog does not fit the grace period, the kill leaves entries that
    # wait out the claim idle time.
    assert before.killed, before
    assert before.pickup_s is not None and before.pickup_s >= claim_idle_ms / 1000 - 1, before
