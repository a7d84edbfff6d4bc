"""The benchmark's naive baseline computes the same numbers as the executor (fair comparison)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.models import random_tokens, tiny_causal
from worker.commands import bench as bench_command
from worker.devtools.bench import executor as bench
from worker.devtools.bench.executor import format_table, naive_logps, ragged_inputs
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor


def test_naive_baseline_agrees_with_executor() -> None:
    model = tiny_causal("llama")
    seqs = [SequenceInput(random_tokens(n, n), prompt_len=p) for n, p in ((20, 5), (9, 8), (14, 1))]
    ours = StatelessExecutor(ExecutorConfig(), model).score(seqs).scores
    with torch.inference_mode():  # the bench runs it so
        naive = naive_logps(model, seqs)
    for a, b in zip(naive, ours, strict=True):
        assert a.shape == b.logps.shape
        assert np.abs(a - b.logps).max() <= 1e-4


def test_ragged_inputs_are_deterministic_rl_shapes() -> None:
    a, b = ragged_inputs(quick=True), ragged_inputs(quick=True)
    assert [list(x.tokens) for x in a] == [list(x.tokens) for x in b]
    for s in a:
        assert 64 <= s.prompt_len <= 256 and 16 <= len(s.tokens) - s.prompt_len <= 1024


def test_table_lists_every_row() -> None:
    row = {
        "seconds": 1.0,
        "tokens_per_s": 10.0,
        "peak_extra_bytes": 2**20,
        "real_tokens": 10,
        "scored_tokens": 5,
    }
    ratio = {
        "side": "ratio",
        "time_ratio": 0.3,
        "peak_memory_ratio": 0.1,
        "tokens_per_s_ratio": 3.0,
        "logps_agree": True,
        "met": True,
    }
    doc = {"rows": {"x_naive": row, "x_ratio": ratio}, "meta": {"memory_method": "m"}}
    table = format_table(doc)
    assert "x_naive" in table and "x_ratio" in table and "time x0.300" in table


def test_bench_entry_point_writes_table_and_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``scoring-worker bench --suite executor --quick -- --json PATH`` end to end, on a tiny
    model and tiny scenarios (the real ones take minutes)."""
    monkeypatch.setattr(bench, "build_model", lambda vocab: tiny_causal("llama", vocab=vocab))
    monkeypatch.setattr(bench, "DENSE", {"vocab": 128, "batch": 3, "length": 24, "scored": 10})
    monkeypatch.setattr(
        bench, "RAGGED", {"vocab": 96, "sequences": 5, "prompt": (2, 6), "completion": (1, 12)}
    )
    out = tmp_path / "bench.json"
    parser = argparse.ArgumentParser()
    bench_command.configure(parser)
    args = parser.parse_args(["--suite", "executor", "--quick", "--", "--json", str(out)])
    assert bench_command.run(args) == 0

    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert list(rows) == [
        f"{s}_{side}" for s in ("dense", "ragged") for side in ("naive", "executor", "ratio")
    ] + ["teacher_v128k"]
    teacher = rows["teacher_v128k"]  # logps + entropy + top-64 vs logps alone and vs naive
    assert teacher["agree"] is True and teacher["vocab"] == 128 and teacher["topk"] == 64
    assert (
        set(teacher["seconds"]) == set(teacher["peak_extra_bytes"]) == {"teacher", "logps", "naive"}
    )
    assert teacher["time_vs_logps"] == pytest.approx(
        teacher["seconds"]["teacher"] / teacher["seconds"]["logps"]
    )
    assert isinstance(teacher["met"], bool)
    for scenario in ("dense", "ragged"):
        naive, execu = rows[f"{scenario}_naive"], rows[f"{scenario}_executor"]
        assert naive["real_tokens"] == execu["real_tokens"] > 0
        assert naive["scored_tokens"] == execu["scored_tokens"] > 0
        assert execu["seconds"] == min(execu["times"]) > 0
        ratio = rows[f"{scenario}_ratio"]
        assert ratio["logps_agree"] is True
        assert ratio["time_ratio"] == pytest.approx(execu["seconds"] / naive["seconds"])
        assert isinstance(ratio["met"], bool) and ratio["targets"]
    assert rows["dense_executor"]["real_tokens"] == 3 * 24
    assert rows["dense_executor"]["scored_tokens"] == 3 * 10
    assert doc["meta"]["quick"] is True and doc["meta"]["ragged"]["sequences"] == 16
    assert doc["meta"]["dense"]["vocab"] == 128 and doc["meta"]["ragged"]["vocab"] == 96

    printed = capsys.readouterr().out
    for name in rows:
        assert name in printed
    assert f"wrote {out}" in printed and "peak MB" in printed


def test_make_bench_runs_the_headline_with_its_short_presets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`make bench` (no --suite) gives each headline suite its preset, user arguments after it."""
    calls: list[tuple[str, list[str]]] = []

    class Suite:
        def __init__(self, name: str) -> None:
            self.name = name

        def main(self, argv: list[str]) -> int:
            calls.append((self.name, argv))
            return 0

    monkeypatch.setattr(bench_command.importlib, "import_module", Suite)
    parser = argparse.ArgumentParser()
    bench_command.configure(parser)
    assert bench_command.run(parser.parse_args(["--", "--json", "x.json"])) == 0
    by_module = {name.rsplit(".", 1)[-1]: argv for name, argv in calls}
    assert by_module["naive"] == ["--rounds", "1", "--json", "x.json"]
    assert by_module["floor"] == ["--reps", "1", "--json", "x.json"]
    assert set(by_module) == {"naive", "executor", "floor", "e2e", "small"}
    calls.clear()
    assert bench_command.run(parser.parse_args(["--suite", "naive"])) == 0
    assert calls == [("worker.devtools.bench.naive", [])]  # a named suite: its own defaults
