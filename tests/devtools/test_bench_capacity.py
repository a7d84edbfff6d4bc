"""The capacity benchmark (worker/devtools/bench/capacity.py):
projection arithmetic and one small real run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from worker.devtools.bench.capacity import RunResult, format_table, main, projection


def _run(workers: int, partitions: int, jps: float, drain: float, enq: float) -> RunResult:
    return RunResult(workers, partitions, 1000, 1000 / jps, jps, drain, drain, enq, 0, 2100)


def test_projection_scales_per_primary_figures() -> None:
    runs = [_run(1, 1, 1000.0, 40.0, 10.0), _run(2, 4, 2000.0, 30.0, 10.0), _run(4, 4, 1500, 50, 9)]
    proj = projection(runs, [1, 3])
    # median drain 40 ms + median enqueue 10 ms per 1k jobs = 0.05 ms per job -> 20k jobs/s.
    assert proj["redis_cpu_ms_per_job_total"] == pytest.approx(0.05)
    assert proj["redis_cpu_bound_jobs_per_s_per_primary"] == pytest.approx(20000.0)
    assert proj["measured_config"] == {"workers": 2, "partitions": 4}
    assert proj["rows"] == [
        {
            "primaries": 1,
            "measured_basis_jobs_per_s": 2000.0,
            "redis_cpu_bound_jobs_per_s": 20000.0,
        },
        {
            "primaries": 3,
            "measured_basis_jobs_per_s": 6000.0,
            "redis_cpu_bound_jobs_per_s": 60000.0,
        },
    ]
    table = format_table(runs, proj)
    assert "assumptions:" in table and "60000" in table


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_small_capacity_run_answers_every_job(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not on PATH")
    out = tmp_path / "capacity.json"
    rc = main(["--workers", "1", "--partitions", "2", "--jobs", "300", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    (run,) = report["results"]
    assert run["workers"] == 1 and run["partitions"] == 2
    assert run["jobs"] == 302 and run["errors"] == 0  # 300 preloaded + one gate job per partition
    assert run["jobs_per_s"] > 0 and run["redis_cpu_ms_per_1k_jobs"] > 0
    assert report["projection"]["rows"][0]["primaries"] == 1
