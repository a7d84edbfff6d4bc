"""Per-job adapters through real subprocess workers: interleaved jobs for three adapters (and the
base) in one queue, provenance and metrics; a ``kill -9`` during an adapter load loses nothing;
a load slower than the claim idle time keeps its lease."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest
import redis
from transformers import AutoModelForCausalLM

from tests.support.adapters import ADAPTERS, merged_float64, naive_logps, write_fleet
from tests.support.daemon import WorkerProc, collect, enqueue, metric, pending_of, wait_until
from tests.support.models import random_tokens
from worker import keys

pytestmark = [pytest.mark.redis, pytest.mark.slow]

SLOW_LOAD = """
import os, time
import worker.executor.weights.adapters as adapters
_load = adapters.load_lora
def _slow(*args, **kwargs):
    print("slow adapter load starts", flush=True)
    time.sleep(float(os.environ["SLOW_LOAD_S"]))
    return _load(*args, **kwargs)
adapters.load_lora = _slow
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_fleet(tmp_path_factory.mktemp("fleet"), versions=1)


def _args(url: str, queue: str, consumer: str, fleet: dict[str, Path], *extra: str) -> list[str]:
    return [
        "--redis-url", url, "--queue", queue, "--consumer", consumer, "--device", "cpu",
        "--reference-model", str(fleet["base"]), "--adapter-root", str(fleet["adapters"]),
        "--model-root", str(fleet["models"]), "--metrics-port", "0", "--max-wait-ms", "20",
        *extra,
    ]  # fmt: skip


def _slow_env(tmp_path: Path, seconds: float) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SLOW_LOAD)
    return {"PYTHONPATH": str(site), "SLOW_LOAD_S": str(seconds)}


def _seq(i: int) -> dict:
    return {"tokens": [int(t) for t in random_tokens(8 + i % 5, 100 + i)], "prompt_len": 3}


@pytest.mark.timeout(240)
def test_interleaved_adapters_in_one_queue(
    redis_url: str, fleet: dict[str, Path], key_prefix: str, tmp_path: Path
) -> None:
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    client = redis.Redis.from_url(redis_url)
    names = [*ADAPTERS, None]
    jobs = [(f"j{i}", names[i % 4], _seq(i)) for i in range(24)]
    for job_id, name, seq in jobs:  # queued first: every batch window sees all four
        enqueue(client, stream, job_id, reply, [seq], adapter=name)
    enqueue(client, stream, "bad", reply, [_seq(0)], adapter="../base")
    enqueue(client, stream, "missing", reply, [_seq(0)], adapter="nope")
    worker = WorkerProc(
        _args(redis_url, key_prefix, "w1", fleet, "--max-resident-adapters", "2"),
        tmp_path / "w.log",
    )
    try:
        worker.wait_ready()
        results, dups = collect(client, reply, [j[0] for j in jobs] + ["bad", "missing"], 120)
        assert dups == 0
        assert results["bad"].error["code"] == "bad_request"
        assert results["missing"].error["code"] == "model_not_found"
        base = AutoModelForCausalLM.from_pretrained(str(fleet["base"])).eval()
        models = {n: merged_float64(base, fleet["adapters"] / n) for n in ADAPTERS}
        models[None] = base.double()
        prints = {}
        for job_id, name, seq in jobs:
            res = results[job_id]
            assert res.ok, res.error
            assert res.info.get("adapter") == name
            if name is not None:
                prints.setdefault(name, res.info["weights_fingerprint"])
                assert res.info["weights_fingerprint"] == prints[name]
            want = naive_logps(models[name], np.array(seq["tokens"]), 3)
            assert np.abs(np.asarray(res.seqs[0].logps) - want).max() <= 1e-4
        assert len(set(prints.values())) == 3
        url = worker.metrics_url
        jobs_named = sum(
            metric(url, "scoring_weights_jobs_total", f'{{result="{r}"}}') for r in ("hit", "miss")
        )
        assert jobs_named == 18
        loads = metric(
            url, "scoring_weights_loads_total", '{kind="adapter",outcome="ok",reason="miss"}'
        )
        assert loads >= 3
        assert metric(url, "scoring_weights_resident", '{kind="adapter"}') <= 2
        assert "Traceback" not in worker.log()
    finally:
        worker.stop()


@pytest.mark.timeout(240)
def test_kill9_during_an_adapter_load_loses_nothing(
    redis_url: str, fleet: dict[str, Path], key_prefix: str, tmp_path: Path
) -> None:
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    client = redis.Redis.from_url(redis_url)
    slow = WorkerProc(
        _args(redis_url, key_prefix, "slow", fleet, "--claim-idle-ms", "1000"),
        tmp_path / "slow.log",
        env=_slow_env(tmp_path, 60),
    )
    fast = None
    try:
        slow.wait_ready()
        ids = [f"k{i}" for i in range(6)]
        for i, job_id in enumerate(ids):
            enqueue(client, stream, job_id, reply, [_seq(i)], adapter=ADAPTERS[i % 2])
        slow.wait_log("slow adapter load starts", 60)
        assert pending_of(client, stream, keys.DEFAULT_GROUP, "slow") > 0
        slow.signal(signal.SIGKILL)
        slow.wait_exit(10)
        fast = WorkerProc(
            _args(redis_url, key_prefix, "fast", fleet, "--claim-idle-ms", "1000"),
            tmp_path / "fast.log",
        )
        results, dups = collect(client, reply, ids, timeout=120)
        assert dups == 0 and all(r.ok for r in results.values())
        assert {r.info["worker"] for r in results.values()} == {"fast"}
        assert {r.info["adapter"] for r in results.values()} == set(ADAPTERS[:2])
        wait_until(lambda: pending_of(client, stream, keys.DEFAULT_GROUP) == 0, 20, what="acks")
    finally:
        slow.stop()
        if fast is not None:
            fast.stop()


@pytest.mark.timeout(240)
def test_a_slow_load_keeps_its_lease(
    redis_url: str, fleet: dict[str, Path], key_prefix: str, tmp_path: Path
) -> None:
    """The load takes 4 s, the claim idle time is 0.8 s: a second worker started meanwhile must
    reclaim nothing (the lease keeper renews while the scoring thread loads)."""
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    client = redis.Redis.from_url(redis_url)
    ids = [f"s{i}" for i in range(4)]
    for i, job_id in enumerate(ids):  # queued first: the loader reads them all at once
        enqueue(client, stream, job_id, reply, [_seq(i)], adapter=ADAPTERS[0])
    loader = WorkerProc(
        _args(redis_url, key_prefix, "loader", fleet, "--claim-idle-ms", "800"),
        tmp_path / "loader.log",
        env=_slow_env(tmp_path, 4),
    )
    other = None
    try:
        loader.wait_log("slow adapter load starts", 60)
        other = WorkerProc(
            ["--redis-url", redis_url, "--queue", key_prefix, "--consumer", "other",
             "--scorer", "noop", "--metrics-port", "0", "--claim-idle-ms", "800"],
            tmp_path / "other.log",
        )  # fmt: skip
        other.wait_ready()
        results, dups = collect(client, reply, ids, timeout=60)
        assert dups == 0
        assert {r.info["worker"] for r in results.values()} == {"loader"}
        assert metric(other.metrics_url, "scoring_entries_reclaimed_total") == 0
    finally:
        loader.stop()
        if other is not None:
            other.stop()


@pytest.mark.timeout(240)
def test_info_shows_what_a_real_worker_holds(
    redis_url: str, fleet: dict[str, Path], key_prefix: str, tmp_path: Path, capsys
) -> None:
    """A worker started with two preloaded adapters lists them in ``scoring-worker info``
    (from its heartbeat) with the fingerprints its results carry; a third adapter loaded by a
    job appears too, and the bytes add up."""
    import json

    from worker.cli import main

    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    client = redis.Redis.from_url(redis_url)
    worker = WorkerProc(
        _args(redis_url, key_prefix, "holder", fleet, "--preload", ",".join(ADAPTERS[:2])),
        tmp_path / "holder.log",
    )

    def held() -> dict:
        assert main(["info", "--redis-url", redis_url, "--queue", key_prefix, "--json"]) == 0
        workers = json.loads(capsys.readouterr().out)["workers"]
        return {w["consumer"]: w for w in workers}.get("holder", {}).get("resident") or {}

    try:
        worker.wait_ready()
        wait_until(lambda: len(held().get("adapters", {})) == 2, 30, what="heartbeat")
        ids = [f"h{i}" for i in range(3)]
        for i, job_id in enumerate(ids):
            enqueue(client, stream, job_id, reply, [_seq(i)], adapter=ADAPTERS[i])
        results, _ = collect(client, reply, ids, 120)
        prints = {r.info["adapter"]: r.info["weights_fingerprint"] for r in results.values()}
        wait_until(lambda: len(held().get("adapters", {})) == 3, 30, what="next heartbeat")
        resident = held()
        adapters = resident["adapters"]
        assert set(adapters) == set(ADAPTERS)
        assert {n: a["fingerprint"] for n, a in adapters.items()} == prints
        assert resident["bytes"] == sum(a["bytes"] for a in adapters.values()) > 0
        assert main(["info", "--redis-url", redis_url, "--queue", key_prefix]) == 0
        assert f"adapter {ADAPTERS[2]}" in capsys.readouterr().out
    finally:
        worker.stop()
