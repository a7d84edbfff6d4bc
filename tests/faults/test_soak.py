"""The soak run's short variant (60 s in ``make test-faults``, 20 s inside ``make test``): a
no-op worker under a steady mix of valid, bad, expired and poison jobs, with a worker restart
and a Redis kill -9 + AOF restart; nothing lost, no fd or thread growth, every key bounded.
``make soak DURATION=30m`` is the long run (docs/guarantees.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from worker.devtools.bench import soak

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.redis]


@pytest.mark.timeout(600)
def test_short_soak(tmp_path: Path, faults_full: bool) -> None:
    if not shutil.which("redis-server"):
        pytest.skip("redis-server not on PATH")
    code = soak.main(
        ["--duration", "60s" if faults_full else "20s", "--rate", "20", "--sample-s", "1",
         "--warmup-frac", "0.2", "--out", str(tmp_path)]
    )  # fmt: skip
    report = json.loads((tmp_path / "soak.json").read_text())
    counts = report["counts"]
    assert counts["lost"] == 0 and counts["answered"] == counts["valid"] > 0, counts
    assert counts["bad"] and counts["expired"] and counts["poison"]
    assert report["worker_alive"]
    assert report["keys_without_ttl"] == []
    assert report["dead_letters"] == counts["poison"]
    drift = report["drift"]
    assert drift["fds"]["end"] <= drift["fds"]["start"], drift
    assert drift["threads"]["end"] <= drift["threads"]["start"], drift
    assert [what for _, what in report["events"]] == [
        "worker restart (SIGTERM, drain, start)",
        "redis kill -9 + restart on AOF",
    ]
    assert code == 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
