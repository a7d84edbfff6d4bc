"""The floor benchmark (``scoring-worker bench --suite floor``) end to end on a tiny model: it
checks the executor's log-probs against the floor's, prints the ``executor/floor`` ratio line and
writes the figures; the real models take minutes, so a tiny one stands in (no timing asserted)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from tests.support.models import tiny_causal
from worker.commands import bench as bench_command
from worker.devtools.bench import floor


def test_floor_suite_prints_the_ratio_and_writes_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(floor, "load_model", lambda name: tiny_causal("llama", vocab=96))
    monkeypatch.setattr(floor, "PROMPT", (2, 6))
    monkeypatch.setattr(floor, "COMPLETION", (1, 12))
    out = tmp_path / "floor.json"
    parser = argparse.ArgumentParser()
    bench_command.configure(parser)
    args = parser.parse_args(
        ["--suite", "floor", "--quick", "--", "--models", "synthetic-32k", "--json", str(out)]
    )
    assert bench_command.run(args) == 0
    printed = capsys.readouterr().out
    assert re.search(r"synthetic-32k: executor/floor \d+\.\d\dx", printed), printed
    (doc,) = json.loads(out.read_text())["models"]
    sides = doc["sides"]
    assert set(sides) == {"floor", "executor"} and doc["sequences"] == 4
    executor = sides["executor"]
    assert executor["max_abs_logp_diff"] <= floor.LOGP_TOL
    assert executor["ratio"] > 0 and sides["floor"]["ratio"] == 1.0
    for key in ("backbone_s", "head_s", "reduce_s", "plan_s"):  # the breakdown
        assert key in executor
    assert "0 padded" in executor["layout"]  # CPU default: unmasked buckets without padding


def test_floor_exit_code_flags_disagreeing_logps(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An executor whose log-probs differ from the floor model's fails the suite (exit 1)."""
    monkeypatch.setattr(floor, "load_model", lambda name: tiny_causal("llama", vocab=96))
    monkeypatch.setattr(floor, "PROMPT", (2, 6))
    monkeypatch.setattr(floor, "COMPLETION", (1, 12))
    monkeypatch.setattr(floor, "LOGP_TOL", -1.0)
    assert floor.main(["--models", "synthetic-32k", "--quick"]) == 1
    assert "executor/floor" in capsys.readouterr().out


def test_variants_parse_numbers_and_booleans() -> None:
    from worker.devtools.bench.floor import _parse_variant

    assert _parse_variant("packing=packed,packed_row_tokens=1024,native_head=false") == {
        "packing": "packed",
        "packed_row_tokens": 1024,
        "native_head": False,
    }
    assert _parse_variant("native_head=True,temperature=0.5") == {
        "native_head": True,
        "temperature": 0.5,
    }
