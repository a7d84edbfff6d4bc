"""End-to-end smoke run of ``bench --suite vision`` (small models, one group): a GRPO image job
through Redis runs its prompt, image included, once through the backbone with sharing and its
image once through the vision tower with prefix sharing on or off, once per sequence with
``--image-sharing off`` too; the figures agree with the workloads' arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.devtools.bench import vision as bench_vision

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def test_workloads_count_unique_tokens_and_patches() -> None:
    works = {w.name: w for w in bench_vision.make_workloads("qwen2_5_vl", 2, 1000)}
    grpo, agent = works["grpo"], works["agent"]
    prompt = 64 + 256 + 2  # text, the 448 x 448 image's tokens, vision start and end
    assert grpo.unique == 2 * (prompt + 8 * 128) and grpo.total == 2 * 8 * (prompt + 128)
    assert grpo.patches == 2 * 32 * 32 and agent.patches == 2 * (32 * 32 + 8 * 16 * 16)
    assert grpo.every_patch == 8 * grpo.patches and agent.every_patch == 2 * 8 * (32 * 32 + 16 * 16)
    assert agent.unique == 2 * (prompt + 8 * (128 + 64 + 2)) and agent.scored == 2 * 8 * 128
    costs = bench_vision.Costs(params=0, backbone=1.0, head=0.0, patch=0.0)
    assert grpo.flop_bound(costs) == pytest.approx(grpo.total / grpo.unique)
    tower = bench_vision.Costs(params=0, backbone=1.0, head=0.0, patch=1.0)
    assert grpo.flop_bound(tower, alone=True) == pytest.approx(
        (grpo.total + grpo.every_patch) / (grpo.unique + grpo.patches)
    )


@pytest.mark.timeout(600)
def test_bench_vision_end_to_end(redis_url: str, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "vision.json"
    rc = bench_vision.main(
        ["--quick", "--arch", "qwen2_5_vl", "--only", "grpo", "--threads", "1",
         "--redis-url", redis_url, "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    assert "qwen2_5_vl" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())
    assert row["forward_on"] == row["unique_tokens"] and row["forward_off"] == row["total_tokens"]
    assert row["tower_images_on"] == row["tower_images_off"] == 1  # one job, one image
    assert row["tower_images_alone"] == 8  # once per sequence: G = 8
    assert 1.0 < row["flop_bound"] <= row["token_bound"] and row["flop_bound_alone"] > 1.0
