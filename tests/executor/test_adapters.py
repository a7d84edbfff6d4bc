"""Per-job LoRA adapters and versions in the executor: math against float64 merged weights, the
base untouched, residency (LRU eviction, one load per name, preload) and path safety."""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.adapters import ADAPTERS, merged_float64, naive_logps, save_lora, write_fleet
from tests.support.models import random_tokens, tiny_reward
from worker.errors import BadRequest, ModelNotFound
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.executor.weights.residency import Residency, Resident, WeightsConfig
from worker.scorer import ScoreOptions


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_fleet(tmp_path_factory.mktemp("fleet"))


@pytest.fixture(scope="module")
def base(fleet: dict[str, Path]) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(fleet["base"])).eval()


def _executor(
    fleet: dict[str, Path], packing: str = "auto", **weights: object
) -> StatelessExecutor:
    cfg = WeightsConfig(
        adapter_root=str(fleet["adapters"]), model_root=str(fleet["models"]), **weights
    )  # type: ignore[arg-type]
    return StatelessExecutor.from_pretrained(
        # unmasked: a pad fraction of 1 puts sequences of different lengths in one bucket
        ExecutorConfig(packing=packing, bucket_pad_fraction=1.0 if packing == "unmasked" else None),  # type: ignore[arg-type]
        str(fleet["base"]),
        weights=cfg,
    )


def _seqs() -> list[SequenceInput]:
    return [SequenceInput(random_tokens(n, i), prompt_len=3) for i, n in enumerate((11, 24, 6))]


def _check(out_scores: list, model: torch.nn.Module, seqs: list[SequenceInput]) -> None:
    for s, score in zip(seqs, out_scores, strict=True):
        want = naive_logps(model, s.tokens, 3)
        assert np.abs(score.logps - want).max() <= 1e-4


@pytest.mark.parametrize("packing", ["packed", "unmasked", "padded"])
def test_adapter_scores_equal_merged_float64(fleet, base, packing: str) -> None:
    ex = _executor(fleet, packing)
    seqs = _seqs()
    for name in ADAPTERS[:2]:
        out = ex.score(seqs, options=ScoreOptions(adapter=name))
        _check(out.scores, merged_float64(base, fleet["adapters"] / name), seqs)
        report = out.metrics.weights
        assert report is not None and report.adapter == name and report.hit is False
        assert packing != "unmasked" or out.metrics.padded_tokens > 0  # pads without a mask
        assert report.fingerprint and len(report.fingerprint) == 16
        assert report.provenance()["adapter"] == name
    prints = {
        ex.score(seqs, options=ScoreOptions(adapter=n)).metrics.weights.fingerprint
        for n in ADAPTERS
    }
    assert len(prints) == 3  # same shapes, different weights: different fingerprints
    # the adapters really differ from the base and from each other
    a, b = (ex.score(seqs, options=ScoreOptions(adapter=n)).scores[0].logps for n in ADAPTERS[:2])
    assert np.abs(a - b).max() > 1e-2


def test_no_adapter_is_exactly_the_base(fleet, base) -> None:
    plain = StatelessExecutor(ExecutorConfig(), base)
    ex = _executor(fleet)
    seqs = _seqs()
    want = [s.logps for s in plain.score(seqs).scores]
    plain.close()
    for name in (ADAPTERS[0], None, ADAPTERS[1], None):
        out = ex.score(seqs, options=ScoreOptions(adapter=name))
        if name is None:
            assert out.metrics.weights is None
            for got, w in zip(out.scores, want, strict=True):
                assert np.array_equal(got.logps, w)  # bit for bit: hooks add nothing


def test_eviction_under_a_tiny_budget_reloads_correctly(fleet, base) -> None:
    ex = _executor(fleet, max_resident_adapters=1)
    seqs = _seqs()
    reasons = []
    for name in (ADAPTERS[0], ADAPTERS[1], ADAPTERS[0], ADAPTERS[0]):
        out = ex.score(seqs, options=ScoreOptions(adapter=name))
        _check(out.scores, merged_float64(base, fleet["adapters"] / name), seqs)
        report = out.metrics.weights
        assert report is not None and report.holdings.adapters == (name,)
        reasons += [e.reason for e in report.loads]
    assert reasons == ["miss", "miss", "evict"]  # the 4th call is a hit
    # a byte budget: one adapter's worth
    size = out.metrics.weights.holdings.bytes
    ex = _executor(fleet, max_resident_bytes=size + 1)
    for name in ADAPTERS:
        held = ex.score(seqs, options=ScoreOptions(adapter=name)).metrics.weights.holdings
        assert held.adapters == (name,) and held.bytes <= size + 1


def test_versions_load_from_model_root(fleet, base) -> None:
    ex = _executor(fleet)
    seqs = _seqs()
    step1 = AutoModelForCausalLM.from_pretrained(str(fleet["models"] / "step-1")).eval()
    out = ex.score(seqs, options=ScoreOptions(version="step-1"))
    _check(out.scores, step1.double(), seqs)
    assert out.metrics.weights.version == "step-1"
    assert out.metrics.weights.holdings.versions == ("step-1",)
    # an adapter on top of a version, and the base afterwards
    both = ex.score(seqs, options=ScoreOptions(version="step-1", adapter=ADAPTERS[2]))
    _check(both.scores, merged_float64(step1, fleet["adapters"] / ADAPTERS[2]), seqs)
    assert both.metrics.weights.hit is False  # the version is resident, the adapter was not
    again = ex.score(seqs, options=ScoreOptions(version="step-1", adapter=ADAPTERS[2]))
    assert again.metrics.weights.hit is True and again.metrics.weights.loads == ()
    assert again.metrics.weights.fingerprint not in (None, out.metrics.weights.fingerprint)
    _check(ex.score(seqs).scores, copy.deepcopy(base).double(), seqs)


def test_every_traversal_attempt_is_refused(fleet, tmp_path) -> None:
    ex = _executor(fleet)
    outside = tmp_path / "outside"
    save_lora(AutoModelForCausalLM.from_pretrained(str(fleet["base"])), outside, seed=9)
    for root in (fleet["adapters"], fleet["models"]):
        if not (root / "escape").exists():
            os.symlink(outside, root / "escape")  # resolves outside the root
    seqs = _seqs()
    bad = [
        "../base", "/etc", str(outside), "a/../../base", "..", ".", "", "a//b", "x\\..\\y",
        "escape", "run42/../../models/step-0", "~/x", "c:/x", "a\x00b",
    ]  # fmt: skip
    for name in bad:
        for options in (ScoreOptions(adapter=name), ScoreOptions(version=name)):
            with pytest.raises(BadRequest):
                ex.validate(seqs, options=options)
            with pytest.raises(BadRequest):
                ex.score(seqs, options=options)
    for options in (ScoreOptions(adapter="nope"), ScoreOptions(version="step-9")):
        with pytest.raises(ModelNotFound):
            ex.score(seqs, options=options)
    # a version directory that holds no checkpoint, an adapter directory with no adapter
    with pytest.raises(ModelNotFound):
        ex.score(seqs, options=ScoreOptions(adapter="run42"))
    plain = StatelessExecutor(
        ExecutorConfig(), AutoModelForCausalLM.from_pretrained(str(fleet["base"]))
    )
    with pytest.raises(ModelNotFound):
        plain.validate(seqs, options=ScoreOptions(adapter=ADAPTERS[0]))


def test_unsupported_adapters_are_refused(fleet, tmp_path) -> None:
    root = tmp_path / "ad"
    save_lora(AutoModelForCausalLM.from_pretrained(str(fleet["base"])), root / "dora", seed=3)
    cfg_path = root / "dora" / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "use_dora": True}))
    save_lora(tiny_reward("llama", hidden_size=48), root / "wrong", seed=3)  # another base
    ex = StatelessExecutor.from_pretrained(
        ExecutorConfig(), str(fleet["base"]), weights=WeightsConfig(adapter_root=str(root))
    )
    for name in ("dora", "wrong"):
        with pytest.raises(BadRequest):
            ex.score(_seqs(), options=ScoreOptions(adapter=name))


def test_concurrent_jobs_for_one_adapter_trigger_one_load(tmp_path) -> None:
    (tmp_path / "a").mkdir()
    loads: list[str] = []

    def slow(name: str, path: Path) -> Resident:
        loads.append(name)
        time.sleep(0.3)
        return Resident("adapter", name, object(), 10, "f")

    res = Residency(WeightsConfig(adapter_root=str(tmp_path)), {"adapter": slow})
    hits: list[bool] = []
    threads = [
        threading.Thread(target=lambda: hits.append(res.acquire("adapter", "a")[1]))
        for _ in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert loads == ["a"] and hits == [False] * 6
    assert res.acquire("adapter", "a")[1] is True
    events, _ = res.drain_events()
    assert [(e.reason, e.outcome) for e in events] == [("miss", "ok")]


def test_preload(fleet) -> None:
    ex = _executor(fleet, preload=(ADAPTERS[1], "version:step-0"))
    out = ex.score(_seqs(), options=ScoreOptions(adapter=ADAPTERS[1], version="step-0"))
    report = out.metrics.weights
    assert report.hit is True
    assert sorted(e.reason for e in report.loads) == ["preload", "preload"]


def test_reward_mode_adapter(tmp_path) -> None:
    rm = tiny_reward("llama")
    save_lora(rm, tmp_path / "ad" / "rm", seed=5)
    merged = merged_float64(rm, tmp_path / "ad" / "rm")  # before the executor hooks rm
    ex = StatelessExecutor(
        ExecutorConfig(mode="reward"),
        reward_model=rm,
        weights=WeightsConfig(adapter_root=str(tmp_path / "ad")),
    )
    seqs = _seqs()
    out = ex.score(seqs, options=ScoreOptions(adapter="rm"))
    for s, score in zip(seqs, out.scores, strict=True):
        ids = torch.as_tensor(np.asarray(s.tokens, dtype=np.int64))[None]
        with torch.no_grad():
            want = float(merged(input_ids=ids).logits[0, 0])
        assert abs(score.reward - want) <= 1e-4
    base = ex.score(seqs).scores
    assert abs(base[0].reward - out.scores[0].reward) > 1e-3


def test_three_adapters_fit_a_byte_budget_and_a_fourth_evicts_the_lru(fleet, base, tmp_path):
    """A byte budget of exactly three adapters holds three with no eviction; a fourth evicts
    the least recently used one (not the oldest loaded), which reloads correctly later."""
    import shutil

    root = tmp_path / "adapters"
    for name in ADAPTERS:
        shutil.copytree(fleet["adapters"] / name, root / name)
    save_lora(base, root / "fourth", seed=9)  # same rank and targets: the same bytes
    ex = StatelessExecutor.from_pretrained(
        ExecutorConfig(), str(fleet["base"]), weights=WeightsConfig(adapter_root=str(root))
    )
    seqs = _seqs()
    first = ex.score(seqs, options=ScoreOptions(adapter=ADAPTERS[0])).metrics.weights
    size = first.holdings.bytes
    assert size > 0
    ex = StatelessExecutor.from_pretrained(
        ExecutorConfig(),
        str(fleet["base"]),
        weights=WeightsConfig(adapter_root=str(root), max_resident_bytes=3 * size),
    )
    for name in ADAPTERS:
        report = ex.score(seqs, options=ScoreOptions(adapter=name)).metrics.weights
        assert report.evictions == 0 and report.hit is False
    assert ex.resident()["bytes"] == 3 * size
    assert list(ex.resident()["adapters"]) == list(ADAPTERS)  # LRU order, oldest first
    again = ex.score(seqs, options=ScoreOptions(adapter=ADAPTERS[0])).metrics.weights
    assert again.hit is True and again.loads == ()  # ADAPTERS[1] is now the least recent
    fourth = ex.score(seqs, options=ScoreOptions(adapter="fourth"))
    _check(fourth.scores, merged_float64(base, root / "fourth"), seqs)
    report = fourth.metrics.weights
    assert report.evictions == 1
    assert report.holdings.adapters == (ADAPTERS[2], ADAPTERS[0], "fourth")
    held = ex.resident()
    assert held["bytes"] == 3 * size <= held["budget"]["bytes"]
    assert held["adapters"]["fourth"]["fingerprint"] == report.fingerprint
    back = ex.score(seqs, options=ScoreOptions(adapter=ADAPTERS[1]))
    _check(back.scores, merged_float64(base, root / ADAPTERS[1]), seqs)
    assert [e.reason for e in back.metrics.weights.loads] == ["evict"]
    assert back.metrics.weights.holdings.adapters == (ADAPTERS[0], "fourth", ADAPTERS[1])


def test_an_executor_without_weight_roots_holds_nothing(fleet) -> None:
    ex = StatelessExecutor.from_pretrained(ExecutorConfig(), str(fleet["base"]))
    assert ex.resident() == {}


def test_apply_delta_in_place_equals_the_naive_form() -> None:
    """The hook's in-place ``addmm_`` and its out-of-place fallback both equal
    ``output + scale * (x @ a.T) @ b.T`` in float64."""
    from worker.executor.weights.adapters import LoraDelta, apply_delta

    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(4, 16, generator=g), torch.randn(24, 4, generator=g)
    delta = LoraDelta(a=a, b=b, scale=0.75)
    x, out = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 24, generator=g)
    want = out.double() + 0.75 * (x.double() @ a.double().T) @ b.double().T
    with torch.inference_mode():
        inplace = out.clone()
        assert apply_delta(delta, x, inplace) is None  # modified in place
    assert (inplace.double() - want).abs().max() <= 1e-4
    grad_out = out.clone().requires_grad_(True)  # autograd needs it: out of place, untouched
    fallback = apply_delta(delta, x, grad_out)
    assert fallback is not None and torch.equal(grad_out.detach(), out)
    assert (fallback.detach().double() - want).abs().max() <= 1e-4
    mixed = apply_delta(delta, x.double(), out.double())  # dtypes differ: out of place
    assert mixed is not None and (mixed - want).abs().max() <= 1e-4
