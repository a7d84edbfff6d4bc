"""A bounded load run: several producer threads (``ScoringClient``), 2 subprocess workers with the
noop scorer (queue capacity, not model speed), a redis-server with AOF (``appendfsync everysec``).

Reports jobs/s, p50/p99 end-to-end latency (submit -> result decoded by the client), Redis
``used_memory`` (and peak), and checks nothing is lost or altered. Quick variant: 2,000 jobs; full
(``--faults-full``): 20,000. ``SCORING_LOAD_JOBS`` overrides. The figures go into the session's
fault summary and ``build/faults-summary.json``.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.faults import harness
from tests.faults.harness import Fleet
from tests.faults.servers import have_redis_server
from worker.client import ScoringClient

pytestmark = [
    pytest.mark.faults,
    pytest.mark.slow,
    pytest.mark.redis,
    pytest.mark.skipif(not have_redis_server(), reason="needs redis-server"),
]

PRODUCERS = 4
IN_FLIGHT = 128  # per producer


@pytest.mark.timeout(900)
def test_load_nothing_lost(tmp_path: Path, faults_full: bool) -> None:
    from worker.scorer.noop import NoopScorer

    total = int(os.environ.get("SCORING_LOAD_JOBS", 20_000 if faults_full else 2_000))
    templates = harness.make_templates(16, vocab=1000, seed=3)
    expected = harness.expected_scores(NoopScorer(), templates)
    fleet = Fleet(
        tmp_path,
        workers=2,
        noop_delay_ms=0,
        claim_idle_ms=30_000,
        max_wait_ms=2,
        appendfsync="everysec",
        templates=templates,
        expected=expected,
    )
    submitted: dict[str, float] = {}
    arrived: dict[str, float] = {}
    results: list = []
    lock = threading.Lock()
    each = total // PRODUCERS
    errors: list[BaseException] = []

    def produce(p: int) -> None:
        try:
            with ScoringClient(fleet.url, queue=fleet.queue, block_ms=500) as client:
                offer = client._buffer.offer

                def recording_offer(result, expected=True):  # type: ignore[no-untyped-def]
                    now = time.perf_counter()
                    with lock:
                        results.append(result)
                        arrived.setdefault(result.id, now)
                    return offer(result, expected=expected)

                client._buffer.offer = recording_offer  # type: ignore[method-assign]
                window: list[str] = []
                for k in range(each):
                    job_id = f"load-p{p}-{k}"
                    t = templates[(p * each + k) % len(templates)]
                    with lock:
                        submitted[job_id] = time.perf_counter()
                    client.submit(t.wire(), temperature=t.temperature, job_id=job_id)
                    window.append(job_id)
                    if len(window) >= IN_FLIGHT:
                        client.raw_result(window.pop(0), timeout=120)
                for job_id in window:
                    client.raw_result(job_id, timeout=120)
        except BaseException as exc:
            errors.append(exc)

    try:
        fleet.start()
        admin = fleet.admin()
        t0 = time.perf_counter()
        threads = [threading.Thread(target=produce, args=(p,)) for p in range(PRODUCERS)]
        for t in threads:
            t.start()
        peak_memory = 0
        while any(t.is_alive() for t in threads):
            peak_memory = max(peak_memory, int(admin.info("memory")["used_memory"]))
            time.sleep(0.2)
        wall = time.perf_counter() - t0
        mem = admin.info("memory")
        pending = admin.xpending(fleet.stream, "scoring")["pending"]
    finally:
        fleet.stop()
    assert not errors, errors[0]
    assign = {
        f"load-p{p}-{k}": (p * each + k) % len(templates)
        for p in range(PRODUCERS)
        for k in range(each)
    }
    report = fleet.check("load-noop", set(submitted), set(submitted), results, wall, assign)
    lat_ms = np.array([(arrived[j] - submitted[j]) * 1000 for j in submitted if j in arrived])
    report.notes.update(
        jobs_per_s=round(len(submitted) / wall, 1),
        p50_ms=round(float(np.percentile(lat_ms, 50)), 1),
        p99_ms=round(float(np.percentile(lat_ms, 99)), 1),
        redis_used_memory_bytes=int(mem["used_memory"]),
        redis_peak_used_memory_bytes=max(peak_memory, int(mem["used_memory_peak"])),
        producers=PRODUCERS,
        in_flight_per_producer=IN_FLIGHT,
        workers=2,
    )
    row = report.as_row()
    harness.REPORTS.append(row)
    assert report.lost == 0 and report.altered == 0 and report.errors == 0, row
    assert report.unknown == 0 and pending == 0, row
