"""The GPU check's ``tree`` step (``worker/devtools/gpu_check/tree.py``) on the CPU: its sets
count their tokens as a hand count does, ``--device cpu --tiny --steps tree`` writes every figure
the step promises (agreement, the load check's decision, backbone tokens, seconds and speed-up),
and the step fails when tree rows are turned off at load or disagree with per-sequence rows.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from worker.devtools.gpu_check import model as gpu_model
from worker.devtools.gpu_check import record as gpu_record
from worker.devtools.gpu_check import report as gpu_report
from worker.devtools.gpu_check import shapes as gpu_shapes
from worker.devtools.gpu_check.check import CPU_BUDGET_SCALE

ROOT = Path(__file__).resolve().parents[2]


def test_group_sets_count_their_tokens_by_hand() -> None:
    grpo = gpu_shapes.GroupSet("g", 1024, 8, 128, 2)
    assert grpo.sequences == 16
    assert grpo.tokens == 16 * (1024 + 128) == 18_432
    assert grpo.unique_tokens == 2 * (1024 + 8 * 128) == 4_096
    assert grpo.scored_tokens == 16 * 128
    flat = gpu_shapes.GroupSet("n", 1024, 8, 128, 2, shared=False)
    assert flat.unique_tokens == flat.tokens == 18_432
    names = [s.name for s in gpu_shapes.tree_sets(tiny=False)]
    assert names == ["P1024xG8xC128", "P256xG8xC512", "noshare"]
    for tiny in (True, False):  # every prompt long enough to be shared at the default minimum
        assert all(s.prompt_tokens >= 32 for s in gpu_shapes.tree_sets(tiny))
    assert gpu_shapes.tree_rows("cpu") == (("sdpa", "float32"), ("sdpa", "bfloat16"))
    assert gpu_shapes.tree_rows("cuda")[-1] == ("flash_attention_2", "bfloat16")


def test_group_inputs_share_exactly_the_prompt_within_a_group() -> None:
    gset = gpu_shapes.GroupSet("g", 40, 4, 6, 3)
    seqs = gpu_model.group_inputs(gset, vocab=50)
    assert len(seqs) == 12 and {len(s.tokens) for s in seqs} == {46}
    assert {s.prompt_len for s in seqs} == {40}
    for g in range(3):
        group = [np.asarray(s.tokens) for s in seqs[4 * g : 4 * g + 4]]
        assert all(np.array_equal(t[:40], group[0][:40]) for t in group)
        assert len({int(t[40]) for t in group}) == 4  # the completions part at their first id
    assert not np.array_equal(seqs[0].tokens[:40], seqs[4].tokens[:40])
    flat = gpu_model.group_inputs(gpu_shapes.GroupSet("n", 40, 4, 6, 1, shared=False), vocab=50)
    assert len({tuple(np.asarray(s.tokens)[:40]) for s in flat}) == 4


def _check_tree(out: Path) -> subprocess.CompletedProcess[str]:
    argv = ["--out", str(out), "--device", "cpu", "--tiny", "--steps", "tree"]
    return subprocess.run(
        [sys.executable, "-m", "worker.devtools.gpu_check", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow
def test_the_tree_step_on_cpu_records_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _check_tree(out)
    log = (out / "gpu-check.log").read_text() if (out / "gpu-check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + log[-4000:]
    doc = json.loads((out / "gpu-check.json").read_text())
    step = doc["steps"]["tree"]
    assert step["status"] == "ok" and step["budget_s"] == 35 * CPU_BUDGET_SCALE  # on a CPU
    f = step["figures"]
    sets = {s.name: s for s in gpu_shapes.tree_sets(tiny=True)}
    assert set(f["sets"]) == set(sets) and f["sets"]["P128xG8xC16"]["unique_tokens"] == 512
    assert list(f["rows"]) == ["sdpa/float32", "sdpa/bfloat16"]  # sdpa alone on the CPU
    for key, row in f["rows"].items():
        dtype = row["dtype"]
        limit, mean_limit = gpu_shapes.TREE_TOLERANCE[dtype]
        assert row["status"] == "ok" and row["used"] == {"off": "sdpa", "auto": "sdpa"}, key
        assert row["sharing_enabled"] is True and row["prefix_sharing"]["auto"] == "on"
        assert row["prefix_sharing"]["off"].startswith("off: ")
        for name, gset in sets.items():
            e = row["sets"][name]
            assert e["errors"] == []
            assert (
                0 <= e["max_abs_logp_diff"] <= limit and 0 <= e["mean_abs_logp_diff"] <= mean_limit
            )
            assert e["forward_tokens"] == {"off": gset.tokens, "auto": gset.unique_tokens}
            shared = gset.groups * gset.prompt_tokens if gset.shared else 0
            assert e["shared_prefix_tokens"] == {"off": 0, "auto": shared}
            if dtype == "float32":  # the untimed reference
                assert "seconds" not in e and "vs_float32" not in e
                continue
            assert set(e["seconds"]) == {"off", "auto"} and min(e["seconds"].values()) > 0
            assert e["speedup"] == pytest.approx(e["seconds"]["off"] / e["seconds"]["auto"])
            assert 1 <= e["repetitions"] <= f["max_repetitions"]
            vs = e["vs_float32"]  # bf16 really ran: both sides off the float32 reference
            assert 0 < vs["per_sequence_max"] <= limit and 0 < vs["tree_max"] <= limit
    # the model sees its prompt: a wrong prefix would show far above the float32 tolerance
    assert (
        f["rows"]["sdpa/float32"]["context_effect"] > 10 * gpu_shapes.TREE_TOLERANCE["float32"][0]
    )
    md = (out / "gpu-check.md").read_text()
    assert "## Prefix sharing: tree rows vs per sequence" in md
    assert "| sdpa/bfloat16 | P128xG8xC16 | on | 2,304 / 512 | 256 |" in md
    assert "| tree | ok |" in md and "sdpa/bfloat16: sharing on, P128xG8xC16 " in md


def _run_tree_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The step in process on one small set and the float32 row (the quick way to break it)."""
    from worker.devtools.gpu_check import steps as gpu_steps

    monkeypatch.setattr(gpu_shapes, "TREE_SETS_TINY", gpu_shapes.TREE_SETS_TINY[:1])
    monkeypatch.setattr(gpu_shapes, "tree_rows", lambda device: (("sdpa", "float32"),))
    path = tmp_path / "tree.json"
    code = gpu_steps.run_step("tree", gpu_record.Setup("cpu", True, tmp_path), path)
    doc: dict[str, Any] = json.loads(path.read_text())
    assert code == (0 if doc["status"] == "ok" else 1)
    return doc


def test_the_step_fails_when_the_load_check_turns_sharing_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.executor import core

    monkeypatch.setattr(core, "sharing_check", lambda *a, **k: "tree log-probs differ (probe)")
    doc = _run_tree_step(tmp_path, monkeypatch)
    assert doc["status"] == "failed"
    assert "the load check turned sharing off (off: tree log-probs differ (probe))" in doc["error"]
    row = doc["figures"]["rows"]["sdpa/float32"]
    assert row["sharing_enabled"] is False
    # both sides ran per sequence: the backbone saw every token twice over
    assert row["sets"]["P128xG8xC16"]["forward_tokens"] == {"off": 2304, "auto": 2304}


def test_the_step_fails_when_tree_rows_disagree_with_per_sequence_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tree rows that pass the load check's small probe but give other log-probs at scale."""
    from worker.executor import fallback

    real = fallback.BatchRunner._tree_batch

    def off_by_a_little(self: Any, tree: Any, call: Any) -> Any:
        batch = real(self, tree, call)
        for score in batch.scores:
            score.logps[-1] += 0.01  # the last token of each sequence
        return batch

    monkeypatch.setattr(fallback.BatchRunner, "_tree_batch", off_by_a_little)
    doc = _run_tree_step(tmp_path, monkeypatch)
    assert doc["status"] == "failed"
    assert "sdpa/float32 P128xG8xC16: tree vs per-sequence max |Δlogp| 0.01" in doc["error"]
    entry = doc["figures"]["rows"]["sdpa/float32"]["sets"]["P128xG8xC16"]
    assert entry["forward_tokens"] == {"off": 2304, "auto": 512}  # the tree did run


def test_a_row_that_raises_fails_the_step_and_the_others_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.devtools.gpu_check import steps as gpu_steps

    monkeypatch.setattr(gpu_shapes, "TREE_SETS_TINY", gpu_shapes.TREE_SETS_TINY[:1])
    rows = (("no_such_backend", "float32"), ("sdpa", "float32"))
    monkeypatch.setattr(gpu_shapes, "tree_rows", lambda device: rows)
    path = tmp_path / "tree.json"
    assert gpu_steps.run_step("tree", gpu_record.Setup("cpu", True, tmp_path), path) == 1
    doc = json.loads(path.read_text())
    bad, good = (
        doc["figures"]["rows"]["no_such_backend/float32"],
        doc["figures"]["rows"]["sdpa/float32"],
    )
    assert bad["status"] == "error" and "ConfigError" in bad["reason"]
    assert doc["status"] == "failed" and doc["error"].startswith(
        "CheckFailed: no_such_backend/float32: "
    )
    assert good["status"] == "ok" and good["sets"]["P128xG8xC16"]["max_abs_logp_diff"] == 0


def test_the_step_passes_untouched_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = _run_tree_step(tmp_path, monkeypatch)
    assert doc["status"] == "ok", doc.get("error")
    assert doc["figures"]["rows"]["sdpa/float32"]["sets"]["P128xG8xC16"]["max_abs_logp_diff"] == 0


def test_the_tree_table_is_well_formed_with_missing_rows() -> None:
    doc = {
        "steps": {
            "tree": {
                "status": "ok",
                "figures": {
                    "tolerance": {"bfloat16": {"max": 0.25, "mean": 0.05}},
                    "rows": {
                        "sdpa/bfloat16": {
                            "status": "ok",
                            "sharing_enabled": True,
                            "prefix_sharing": {"auto": "on"},
                            "sets": {"P1024xG8xC128": {"speedup": 4.0, "max_abs_logp_diff": 0.03}},
                        },
                        "flash_attention_2/bfloat16": {
                            "status": "unavailable",
                            "reason": "flash_attn | not importable",
                        },
                    },
                    "notes": ["x"],
                },
            }
        }
    }
    md = gpu_report.render(doc)
    start = md.index("## Prefix sharing")
    table = [line for line in md[start:].splitlines() if line.startswith("|")]
    assert len(table) == 4  # header, rule, one set, the unavailable row
    assert len({len(re.findall(r"(?<!\\)\|", line)) for line in table}) == 1, table
    assert "| flash_attention_2/bfloat16 | unavailable: flash_attn \\| not importable |" in md
    assert gpu_report.summary("tree", doc["steps"]["tree"]) == (
        "sdpa/bfloat16: sharing on, P1024xG8xC128 4.00x, max |Δlogp| 0.03; "
        "flash_attention_2/bfloat16: unavailable"
    )
    assert "- note: x" in md
