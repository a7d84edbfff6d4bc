"""The autoscaling simulation's parts: the HPA algorithm, KEDA's activation and cooldown, the
queueing core's reads and batches, one run end to end, and the sweep's smoke run."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import simpy

from worker.devtools.autoscale import hpa
from worker.devtools.autoscale.fleet import Job, Profile, Stream, take_batch
from worker.devtools.autoscale.keda import Operator, ScaledObject
from worker.devtools.autoscale.sim import percentile, replay, simulate
from worker.devtools.autoscale.workload import RlWorkload


def test_metric_proposal_keeps_the_count_within_the_tolerance() -> None:
    assert hpa.metric_proposal(4, 270, 64) == 4  # ratio 1.05
    assert hpa.metric_proposal(4, 300, 64) == 5  # ratio 1.17: ceil(300 / 64)
    assert hpa.metric_proposal(4, 0, 64) == 0
    assert hpa.metric_proposal(1, 640, 64) == 10


def test_default_scale_up_allows_four_pods_or_double_per_period() -> None:
    state = hpa.HpaState(min_replicas=1, max_replicas=64)
    assert state.decide(0.0, 1, 40) == 5  # max(1 + 4, 2 x 1)
    assert state.decide(5.0, 5, 40) == 5  # still within the 15 s period of that event
    assert state.decide(15.0, 5, 40) == 10  # max(5 + 4, 2 x 5)
    assert state.decide(30.0, 10, 40) == 20
    assert state.decide(45.0, 20, 40) == 40


def test_scale_down_waits_for_the_window_then_follows_the_policy() -> None:
    rules = hpa.Rules(300.0, (hpa.Policy("Pods", 1, 60.0),))
    state = hpa.HpaState(min_replicas=1, max_replicas=16, scale_down=rules)
    assert state.decide(0.0, 8, 8) == 8
    assert state.decide(15.0, 8, 2) == 8  # the window still holds the 8 of t = 0
    assert state.decide(299.0, 8, 2) == 8
    assert state.decide(300.0, 8, 2) == 7  # t = 0 left the window (strictly after the cutoff)
    assert state.decide(330.0, 7, 2) == 7  # one pod per 60 s
    assert state.decide(361.0, 7, 2) == 6
    assert state.decide(1000.0, 6, 0) == 5  # never below minReplicas, one pod at a time


def test_select_policy_min_takes_the_smaller_change() -> None:
    up = hpa.Rules(0.0, (hpa.Policy("Percent", 100, 15.0), hpa.Policy("Pods", 4, 15.0)), "Min")
    state = hpa.HpaState(min_replicas=1, max_replicas=64, scale_up=up)
    assert state.decide(0.0, 10, 40) == 14  # min(20, 14)
    disabled = hpa.HpaState(1, 64, scale_up=hpa.Rules(0.0, up.policies, "Disabled"))
    assert disabled.decide(0.0, 10, 40) == 10


def test_scale_down_policies_max_takes_the_bigger_drop_and_min_the_smaller() -> None:
    policies = (hpa.Policy("Percent", 50, 15.0), hpa.Policy("Pods", 1, 15.0))
    biggest = hpa.HpaState(1, 64, scale_down=hpa.Rules(0.0, policies))
    assert biggest.decide(0.0, 10, 2) == 5  # min(floor(10 x 0.5), 10 - 1)
    assert biggest.decide(5.0, 5, 2) == 5  # the period's start is still 10: 5 is its limit
    smallest = hpa.HpaState(1, 64, scale_down=hpa.Rules(0.0, policies, "Min"))
    assert smallest.decide(0.0, 10, 2) == 9  # max(5, 9)
    disabled = hpa.HpaState(1, 64, scale_down=hpa.Rules(0.0, policies, "Disabled"))
    assert disabled.decide(0.0, 10, 2) == 10


def test_keda_wakes_on_lag_and_scales_to_zero_after_the_cooldown() -> None:
    op = Operator(ScaledObject(cooldown_s=60, activation_lag_count=5))
    assert op.check(0.0, 0, 5, 0) is None  # lag 5 is not > activationLagCount 5
    assert op.check(10.0, 0, 6, 0) == 1
    assert op.check(20.0, 1, 0, 3) is None  # pending entries keep it active
    assert op.check(70.0, 1, 0, 0) is None  # 50 s since the last active check
    assert op.check(80.0, 1, 0, 0) == 0
    keep = Operator(ScaledObject(min_replicas=1, cooldown_s=0))
    assert keep.check(0.0, 1, 0, 0) is None


def test_two_triggers_ask_for_the_larger_metric_and_the_sum_for_both() -> None:
    two = ScaledObject(lag_count=64, pending_count=64)
    assert [hpa.metric_proposal(5, v, t) for v, t in two.metrics(189, 323)] == [3, 5]
    summed = ScaledObject(lag_count=64, combine="sum")
    assert [hpa.metric_proposal(5, v, t) for v, t in summed.metrics(189, 323)] == [8]


def test_a_batch_is_the_oldest_job_and_what_fits_after_it() -> None:
    backlog = [Job(i, n, 0.0) for i, n in enumerate([300, 900, 200, 600, 5000])]
    assert [j.id for j in take_batch(backlog, 1000)] == [0, 2]
    assert [j.id for j in backlog] == [1, 3, 4]
    assert [j.id for j in take_batch([Job(9, 5000, 0.0)], 1000)] == [9]  # too big: alone


def test_blocked_readers_get_one_entry_each_then_the_rest_waits() -> None:
    env = simpy.Environment()
    stream = Stream(env)
    first, second = stream.read_blocking(64), stream.read_blocking(64)
    for i in range(5):
        stream.add(Job(i, 10, 0.0))
    assert [j.id for j in first.value] == [0] and [j.id for j in second.value] == [1]
    assert stream.lag == 3 and stream.pending == 2
    assert [j.id for j in stream.read(64)] == [2, 3, 4]


def test_a_burst_under_one_read_goes_to_one_worker() -> None:
    """40 jobs: the first blocked worker gets one, the second one, then the first reads the
    other 38: a second worker barely helps; 400 jobs spread over both."""
    profile = Profile(s_per_token=1e-4, startup_s=0.0, batch_overhead_s=0.03, max_batch_tokens=2048)
    small = [(0.0, 300)] * 40
    one, two = replay(small, 1, profile), replay(small, 2, profile)
    assert max(two) > 0.9 * max(one)
    big = [(0.0, 300)] * 400
    assert max(replay(big, 2, profile)) < 0.6 * max(replay(big, 1, profile))


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0


def test_scale_to_zero_pays_a_cold_start_each_step() -> None:
    profile = Profile(s_per_token=1e-4, startup_s=20.0)
    work = RlWorkload(gen_s=400.0, prompts=8, group=4, steps=3)
    cold = simulate(
        ScaledObject(min_replicas=0, cooldown_s=60, scale_down_window_s=60), work, profile
    )
    warm = simulate(ScaledObject(min_replicas=1, scale_down_window_s=60), work, profile)
    assert cold.wait_s > warm.wait_s + 20.0  # start-up, plus up to a polling interval
    assert cold.cold_starts_per_step >= 1
    assert warm.pod_s_per_step > cold.pod_s_per_step + 300  # one pod idle through generation


def test_sweep_quick_run_prints_the_tables_and_writes_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from worker.devtools.autoscale import sweep

    rc = sweep.main(
        ["--quick", "--gen-s", "30,300", "--steps", "3", "--prompts", "16", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "trainer wait / step" in out and "pick:" in out
    assert (tmp_path / "autoscale.png").stat().st_size > 10_000
    assert (tmp_path / "results.json").exists()


def test_an_activation_above_a_small_batch_strands_it_at_zero_replicas() -> None:
    """KEDA's activation wins over the scaling target: at zero replicas a tail batch of 16 jobs
    under activationLagCount 64 never wakes the fleet; with 0 it does."""
    profile = Profile(s_per_token=1e-4, startup_s=5.0)
    work = RlWorkload(gen_s=300.0, prompts=16, group=8, steps=2, tail_jobs=16)
    spec = ScaledObject(cooldown_s=60, scale_down_window_s=60, combine="sum")
    assert not simulate(spec, work, profile).stranded
    stranded = simulate(replace(spec, activation_lag_count=64), work, profile)
    assert stranded.stranded and stranded.cost(8.0) == float("inf")


def test_noop_scorer_sleeps_per_batch_and_per_token() -> None:
    """``--noop-us-per-token``: a batch of 3,000 tokens at 10 µs/token and 5 ms/batch takes at
    least 35 ms (a lower bound only: never flaky under load)."""
    import time

    from worker.scorer.inputs import SequenceInput
    from worker.scorer.noop import NoopScorer

    scorer = NoopScorer(delay_ms=5.0, us_per_token=10.0)
    seqs = [SequenceInput(list(range(1, 1001)), 1) for _ in range(3)]
    started = time.perf_counter()
    out = scorer.score(seqs)
    assert time.perf_counter() - started >= 0.035
    assert len(out.scores) == 3
    with pytest.raises(ValueError):
        NoopScorer(us_per_token=-1.0)


def test_a_stopped_worker_hands_back_what_it_has_not_started() -> None:
    """SIGTERM mid-batch: the read-ahead goes back to the stream at once (a blocked worker gets
    it), only the computing batch is finished; with hand_back=False the worker keeps it all."""
    from worker.devtools.autoscale.fleet import Worker

    for hand_back in (True, False):
        env = simpy.Environment()
        stream = Stream(env)
        profile = Profile(
            s_per_token=1e-3, startup_s=0.0, max_batch_tokens=100, hand_back=hand_back
        )
        exited: list[Worker] = []
        a = Worker(env, stream, profile, exited.append)
        env.run(until=0.5)  # a is ready and blocked on the empty stream
        stream.add_many([Job(i, 50, env.now) for i in range(6)])
        env.run(until=0.51)  # a read all 6 (64 at most), computes 0-1 (100 tokens), holds 2-5
        assert [j.id for j in a.backlog] == [2, 3, 4, 5] and stream.lag == 0
        waiting = stream.read_blocking(64)  # another worker blocked on the stream
        a.stop()
        if hand_back:
            assert a.backlog == [] and [j.id for j in waiting.value] == [2, 3, 4, 5]
        else:
            assert len(a.backlog) == 4 and not waiting.triggered
        env.run(until=5.0)
        assert exited == [a]
