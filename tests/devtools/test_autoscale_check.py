"""The autoscaling simulation's queueing core agrees with real workers (``check.py``): one trace of
RL-like bursts through 1 and 2 real noop workers with a fixed per-token cost, on the test Redis,
and through the simulation; p50/p99 latency within the stated tolerance. The same measured runs
must *not* match a core that ignores batching, the read size or the replica count."""

from __future__ import annotations

from dataclasses import replace

import pytest

from worker.devtools.autoscale import check
from worker.devtools.autoscale.sim import percentile, replay

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def measured(machine_redis_url: str) -> dict[int, check.Measured]:
    """The trace through 1 and 2 real workers (about 15 s and 8 s of trace)."""
    import uuid

    costs, trace = check.Costs(), check.Trace()
    return {
        n: check.run_real(machine_redis_url, f"t-ascheck-{uuid.uuid4().hex[:8]}", trace, n, costs)
        for n in (1, 2)
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("replicas", [1, 2])
def test_simulated_latencies_match_real_workers(
    measured: dict[int, check.Measured], replicas: int
) -> None:
    c = check.compare(measured[replicas], check.Costs())
    assert len(measured[replicas].latencies) == sum(n for _t, n in check.Trace().bursts)
    assert c.ok, f"{check.HEADER}\n{c.row()}"


def _misses(measured: dict[int, check.Measured], sim: dict[int, list[float]]) -> bool:
    """True when some replica count's p50 or p99 is outside the tolerance."""
    for n, m in measured.items():
        pair = check.Comparison(
            n,
            (percentile(m.latencies, 50), percentile(m.latencies, 99)),
            (percentile(sim[n], 50), percentile(sim[n], 99)),
        )
        if not pair.ok:
            return True
    return False


@pytest.mark.timeout(180)
def test_a_wrong_core_misses_the_measured_latencies(measured: dict[int, check.Measured]) -> None:
    """The check can fail: each of these mistakes in the core is caught on the same runs."""
    base = check.Costs().profile()
    wrong = {
        "each job alone (no batching)": lambda n, a: replay(
            a, n, replace(base, max_batch_tokens=1)
        ),
        "an ideal shared queue (read 1 entry)": lambda n, a: replay(
            a, n, replace(base, read_count=1)
        ),
        "fixed reads of 64 entries (not sized by the job size)": lambda n, a: replay(
            a, n, replace(base, sized_reads=False)
        ),
        "the other replica count": lambda n, a: replay(a, 3 - n, base),
        "no per-token cost": lambda n, a: replay(a, n, replace(base, s_per_token=0.0)),
    }
    for name, sim in wrong.items():
        got = {n: sim(n, m.arrivals) for n, m in measured.items()}
        assert _misses(measured, got), f"a core with {name} passed the check"
