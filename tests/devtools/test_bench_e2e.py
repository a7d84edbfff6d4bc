"""Smoke test of the end-to-end benchmark row (tiny sizes; the figure itself is not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.devtools.bench import e2e as bench_e2e

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


@pytest.mark.timeout(300)
def test_bench_e2e_reports_pipelined_and_sequential_medians(
    redis_url: str, tmp_path: Path, capsys
) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "e2e.json"
    argv = ["--redis-url", redis_url, "--jobs", "6", "--max-len", "48", "--rounds", "3"]
    assert bench_e2e.main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "(pipelined)" in text and "(--no-pipeline)" in text and "median of 3" in text
    figures = json.loads(out.read_text())
    assert all(len(figures["times"][k]) == 3 for k in ("in-process", "pipelined", "sequential"))
    ratios = sorted(
        i / e
        for i, e in zip(figures["times"]["in-process"], figures["times"]["pipelined"], strict=True)
    )
    assert figures["ratio"] == pytest.approx(ratios[1])


@pytest.mark.timeout(300)
def test_bench_small_jobs_table_through_the_bench_command(redis_url: str, capsys) -> None:  # type: ignore[no-untyped-def]
    from worker.cli import main as cli_main

    argv = ["bench", "--suite", "small", "--", "--redis-url", redis_url, "--jobs", "30",
            "--rate", "200", "--max-wait-ms", "0", "--max-wait-ms", "5"]  # fmt: skip
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [
        ("0", "pipelined"), ("0", "--no-pipeline"), ("5", "pipelined"), ("5", "--no-pipeline")
    ]  # fmt: skip
    for r in rows:
        jobs_per_s, p50, p99 = map(float, r[2:5])
        assert jobs_per_s > 0 and 0 < p50 <= p99


@pytest.mark.timeout(600)
def test_bench_naive_quick_measures_both_processes(redis_url: str, tmp_path: Path) -> None:
    from worker.devtools.bench import naive as bench_naive

    out = tmp_path / "naive.json"
    assert bench_naive.main(["--quick", "--redis-url", redis_url, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["model"] == "synthetic" and row["sequences"] == 4
    for side in ("naive", "worker"):
        assert row[side]["seconds"] > 0 and row[side]["peak_rss_bytes"] > 100 * 2**20
    # full float32 logits over a padded batch: the naive process peaks far above the worker
    assert row["naive"]["peak_rss_bytes"] > row["worker"]["peak_rss_bytes"]
    assert row["speedup"] == pytest.approx(row["naive"]["seconds"] / row["worker"]["seconds"])
    # the arithmetic each side did, from the model's config (the gap's explanation in README)
    flops = row["flops"]
    assert flops["naive"] > flops["worker"] > 0
    assert flops["worker_per_s"] == pytest.approx(flops["worker"] / row["worker"]["seconds"])


def test_forward_flops_counts_the_floor_and_the_padded_naive_way() -> None:
    """By hand: hidden 8, 2 layers, 2 query heads and 1 KV head of 4, MLP 16, vocab 10."""
    from types import SimpleNamespace

    from worker.devtools.bench.naive import forward_flops

    config = SimpleNamespace(
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=4,
        num_key_value_heads=1,
        intermediate_size=16,
        vocab_size=10,
    )
    seqs = [{"tokens": [1] * 3, "prompt_len": 1}, {"tokens": [1] * 5, "prompt_len": 2}]
    linear, attend, head = 2 * 2 * (2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16), 4 * 2 * 8, 2 * 8 * 10
    worker = (3 * linear + attend * 6 + 2 * head) + (5 * linear + attend * 15 + 3 * head)
    naive = 2 * (5 * (linear + head) + attend * 25)  # one padded batch of 2, width 5
    got = forward_flops(config, seqs, batch=2)
    assert (got["worker"], got["naive"]) == (worker, naive)
    assert got["ratio"] == naive / worker
