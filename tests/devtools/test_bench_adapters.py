"""The adapters benchmark runs end to end at toy size (``--quick``) and prints every variant, the
ratios to the base and the load costs; no timing is asserted (the machine is shared)."""

from __future__ import annotations

import json

import pytest

from worker.devtools.bench import adapters as bench_adapters

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_quick_adapters_bench_prints_every_variant(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("peft")
    assert bench_adapters.main(["--quick", "--jobs", "2", "--rounds", "1", "--json"]) == 0
    text = capsys.readouterr().out
    names = [*bench_adapters.VARIANTS, "cold adapter load"]
    assert all(name in text for name in names), text
    doc = json.loads(text[text.index("{") :])
    assert doc["shape"]["model"] == "synthetic" and doc["shape"]["jobs"] == 2
    assert doc["ratio_vs_base"]["base (one model)"] == 1.0
    assert set(doc["jobs_per_s"]) == set(doc["ratio_vs_base"])
    assert all(v > 0 for v in doc["jobs_per_s"].values())
    assert doc["cold_adapter_load_ms"] > 0 and doc["full_model_load_ms"] > 0
