"""End-to-end smoke run of ``bench --suite groups`` (tiny model, smallest shapes): the figures it
prints agree with the arithmetic of the workloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.devtools.bench import groups as bench_groups

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def test_workloads_count_unique_tokens() -> None:
    works = {w.name: w for w in bench_groups.make_workloads(8, 2, 1024)}
    grpo = works["P128xG8xC16"]
    assert grpo.total == 2 * 8 * (128 + 16) and grpo.unique == 2 * (128 + 8 * 16)
    assert works["noshare"].unique == works["noshare"].total == grpo.total
    agent = works["agent3turn"]
    assert agent.unique == 2 * (64 + 2 * 16 + 8 * 16) and agent.total == 2 * 8 * (64 + 32)


@pytest.mark.timeout(300)
def test_bench_groups_end_to_end(redis_url: str, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "groups.json"
    rc = bench_groups.main(
        ["--tiny", "--scale", "8", "--groups", "1", "--rounds", "1", "--threads", "1",
         "--only", "P128xG8xC16", "--only", "noshare", "--redis-url", redis_url,
         "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    assert "P128xG8xC16" in capsys.readouterr().out
    rows = {r["workload"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"P128xG8xC16", "noshare"}
    grpo, flat = rows["P128xG8xC16"], rows["noshare"]
    assert grpo["forward_on"] == grpo["unique_tokens"] == 128 + 8 * 16
    assert grpo["forward_off"] == grpo["total_tokens"] == 8 * (128 + 16)
    assert flat["forward_on"] == flat["forward_off"] == flat["total_tokens"]
    assert grpo["wire_bytes_prefix"] < grpo["wire_bytes_plain"]
    assert flat["wire_bytes_prefix"] == flat["wire_bytes_plain"]
    assert grpo["flop_bound"] > 1.0 and flat["flop_bound"] == pytest.approx(1.0)
    assert grpo["speedup"] == pytest.approx(grpo["time_off_s"] / grpo["time_on_s"])
    assert grpo["peak_rss_off_mib"] > 0 and grpo["peak_rss_on_mib"] > 0
