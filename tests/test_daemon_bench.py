"""Smoke test of the end-to-end benchmark row (tiny sizes; the figure itself is not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.devtools import bench_e2e

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.mark.timeout(180)
def test_bench_e2e_runs_both_paths(redis_url: str, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "e2e.json"
    rc = bench_e2e.main(
        ["--redis-url", redis_url, "--quick", "--jobs", "12", "--max-len", "48", "--json", str(out)]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "in-process" in text and "redis + 1 worker" in text and "throughput" in text
    figures = json.loads(out.read_text())
    assert figures["jobs"] == 12 and figures["in_process_s"] > 0 and figures["e2e_s"] > 0
    assert figures["ratio"] == pytest.approx(figures["in_process_s"] / figures["e2e_s"])
