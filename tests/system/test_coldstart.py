"""Cold start: the phases a worker times and publishes at ready, and the warm-up before ready
(``--warmup``: on for CUDA, off on CPU unless asked)."""

from __future__ import annotations

import argparse
import re
import urllib.request
from pathlib import Path

import pytest
import redis

from tests.support.daemon import WorkerProc, collect, enqueue, wait_until
from worker import keys
from worker.devtools.bench.coldstart import scrape_startup
from worker.observability.startup import StartupClock, process_age_s
from worker.scorer.warmup import warmup_inputs


def test_warmup_inputs_fill_the_budget_within_the_models_length() -> None:
    seqs = warmup_inputs(10_000, vocab_size=50, max_positions=4096, mode="reference")
    assert [len(s.tokens) for s in seqs] == [4096, 4096, 1808]
    assert all(s.prompt_len == 1 and int(max(s.tokens)) < 50 for s in seqs)
    (one,) = warmup_inputs(512, vocab_size=50, max_positions=None, mode="reward")
    assert len(one.tokens) == 512 and one.prompt_len is None


def test_wants_warmup_is_on_for_cuda_only_unless_asked() -> None:
    from worker.commands.serve import wants_warmup

    class Info:
        def __init__(self, device: str) -> None:
            self.info = {"device": device}

    auto = argparse.Namespace(warmup=None)
    assert wants_warmup(auto, Info("cuda:0"))  # type: ignore[arg-type]
    assert not wants_warmup(auto, Info("cpu"))  # type: ignore[arg-type]
    assert wants_warmup(argparse.Namespace(warmup=True), Info("cpu"))  # type: ignore[arg-type]
    assert not wants_warmup(argparse.Namespace(warmup=False), Info("cuda"))  # type: ignore[arg-type]


def test_startup_clock_and_process_age() -> None:
    clock = StartupClock()
    with clock.phase("import"):
        pass
    clock.add("import", 0.5)
    assert 0.5 <= clock.phases["import"] < 1.0
    age = clock.mark("ready")
    assert 0 < age <= process_age_s() + 0.02 and clock.mark("ready") == age  # first call kept
    assert clock.summary().startswith(f"ready after {age:.3f} s: import 0.5")


def _metrics(w: WorkerProc) -> dict[str, float]:
    return scrape_startup(urllib.request.urlopen(w.metrics_url, timeout=5).read().decode())


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("warmup", [True, False], ids=["warmup", "no-warmup"])
def test_warmup_runs_before_ready_and_phases_are_published(
    redis_url: str, key_prefix: str, cleanup_keys: None, tmp_path: Path, warmup: bool
) -> None:
    """A no-op worker whose batch takes 0.4 s: with ``--warmup`` the warm-up batch runs (logged,
    timed) before the worker serves; on the CPU without the flag it does not run at all."""
    args = ["--redis-url", redis_url, "--queue", key_prefix, "--consumer", "cold",
            "--scorer", "noop", "--noop-delay-ms", "400", "--metrics-port", "0",
            "--max-batch-tokens", "256", "--device", "cpu"]  # fmt: skip
    w = WorkerProc([*args, *(["--warmup"] if warmup else [])], tmp_path / "w.log")
    try:
        w.wait_ready()
        log = w.log()
        serving = re.search(r"serving .* \(group ", log)
        assert serving is not None
        warm = re.search(r"warm-up: one both forward of 256 tokens", log)
        figures = _metrics(w)
        if warmup:
            assert warm is not None and warm.start() < serving.start(), log
            assert figures["warmup"] >= 0.4
        else:
            assert warm is None and "warmup" not in figures, log
        assert {"interpreter", "import", "connect", "ready"} <= set(figures)
        assert figures["ready"] >= figures["interpreter"] + figures.get("warmup", 0.0)
        assert re.search(r"startup: ready after [\d.]+ s: interpreter", log)
        client = redis.Redis.from_url(redis_url)
        stream = keys.job_streams(key_prefix)[0]
        reply = keys.reply_stream(stream, "c")
        enqueue(client, stream, "j", reply, [{"tokens": [1, 2, 3], "prompt_len": 1}])
        collect(client, reply, ["j"], timeout=20)
        # the result is on its reply stream just before the worker marks its first result
        first = wait_until(lambda: _metrics(w).get("first_result"), 10, what="first_result")
        assert first > figures["ready"]
    finally:
        w.stop()


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_model_worker_publishes_every_load_phase(
    redis_url: str, key_prefix: str, cleanup_keys: None, tmp_path: Path
) -> None:
    from tests.support.models import tiny_causal

    model_dir = tmp_path / "model"
    tiny_causal("llama", seed=0).save_pretrained(model_dir)
    w = WorkerProc(
        ["--redis-url", redis_url, "--queue", key_prefix, "--consumer", "cold",
         "--reference-model", str(model_dir), "--metrics-port", "0", "--device", "cpu"],
        tmp_path / "w.log",
    )  # fmt: skip
    try:
        w.wait_ready(150)
        figures = _metrics(w)
        for phase in ("interpreter", "import", "model_read", "placement", "self_check"):
            assert phase in figures, (phase, figures)
        assert figures["import"] > 0 and figures["model_read"] > 0 and figures["self_check"] > 0
        assert "warmup" not in figures  # CPU: off unless asked
        loading = figures["import"] + figures["model_read"] + figures["self_check"]
        assert figures["ready"] >= loading
    finally:
        w.stop()


def test_the_quick_probe_runs_fewer_forwards_and_agrees_with_the_full_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reference mode on a causal model: the layouts are checked against one masked reference
    forward (2 executor forwards instead of 5, plus 1 reference forward instead of 3), with the
    same verdict as the full probe."""
    from tests.support.models import tiny_causal
    from worker.executor import ExecutorConfig, StatelessExecutor, selfcheck
    from worker.executor.forward import BatchForward

    layouts: list[str] = []
    compute = BatchForward.compute

    def counting(self: BatchForward, *args: object, **kwargs: object) -> object:
        layouts.append(str(kwargs["layout"]))
        return compute(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(BatchForward, "compute", counting)
    model = tiny_causal("llama", seed=0)
    # the layout probe alone: the prefix-sharing check at load runs forwards of its own
    config = ExecutorConfig(mode="reference", device="cpu", prefix_sharing="off")
    quick = StatelessExecutor(config, model)
    quick_layouts, verdict = list(layouts), (quick.layout, quick.load_fallbacks)
    quick.close()
    layouts.clear()
    monkeypatch.setattr(selfcheck, "_quick_check", lambda *args, **kwargs: None)
    full = StatelessExecutor(config, model)
    assert quick_layouts == ["unmasked", "packed"]
    assert layouts == ["unmasked"] * 4 + ["packed"]  # 3 one by one, the bucket, the packed row
    assert verdict == (full.layout, full.load_fallbacks)
