"""The daemon's batch logic in-process (real Redis, a scripted scorer): poison isolation by
splitting, KV-cache rejection, per-sequence errors, batching under the token budget."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry

from tests.support.daemon import collect, enqueue
from worker import keys
from worker.config import RedisSettings
from worker.daemon import Worker
from worker.daemon.config import WorkerConfig
from worker.errors import KVCacheRejected, TooLong
from worker.observability.metrics import WorkerMetrics
from worker.scorer import SequenceScore
from worker.scorer.noop import NoopScorer

pytestmark = pytest.mark.redis
POISON = 13


class ScriptedScorer(NoopScorer):
    """Noop scores, except: a batch holding token 13 raises; token 14 -> KV rejection;
    a sequence of exactly 9 tokens gets a per-sequence TooLong. Records batch sizes."""

    def __init__(self) -> None:
        super().__init__(vocab_size=100)
        self.calls: list[int] = []

    def score(self, seqs: Any, *, mode: str, temperature: float = 1.0, **options: Any) -> Any:
        self.calls.append(len(seqs))
        flat = {int(t) for s in seqs for t in s.tokens}
        if POISON in flat:
            raise RuntimeError("poisoned batch")
        if 14 in flat:
            raise KVCacheRejected(
                "model returned past_key_values", kv_output_tensors=4, kv_output_bytes=4096
            )
        out = super().score(seqs, mode=mode, temperature=temperature)
        for i, s in enumerate(seqs):
            if len(s.tokens) == 9:
                out.scores[i] = SequenceScore(error=TooLong("9 tokens do not fit"))
        return out


def _run(redis_url: str, stream: str, max_jobs: int, **cfg: Any) -> tuple[Worker, ScriptedScorer]:
    scorer = ScriptedScorer()
    config = WorkerConfig(
        streams=(stream,),
        consumer="inproc",
        metrics_port=None,
        max_jobs=max_jobs,
        block_ms=100,
        claim_idle_ms=5000,
        **cfg,
    )
    worker = Worker(
        config, RedisSettings(url=redis_url), scorer, metrics=WorkerMetrics(CollectorRegistry())
    )
    assert worker.run() == 0
    return worker, scorer


@pytest.mark.timeout(30)
def test_poison_job_isolated_by_splitting(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    ids = [f"j{i}" for i in range(8)]
    for i, job_id in enumerate(ids):
        tokens = [1, 2, POISON if i == 5 else 3]
        enqueue(client, stream, job_id, reply, [{"tokens": tokens, "prompt_len": 1}])
    worker, scorer = _run(redis_url, stream, max_jobs=8)
    results, _ = collect(client, reply, ids, timeout=5)
    assert results["j5"].code == "internal" and "poisoned" in results["j5"].error["message"]
    assert all(results[i].ok for i in ids if i != "j5")
    assert scorer.calls[0] == 8 and len(scorer.calls) > 2  # one batch, then halves
    reg = worker.metrics.registry
    assert reg.get_sample_value("scoring_jobs_total", {"outcome": "ok"}) == 7
    assert reg.get_sample_value("scoring_jobs_total", {"outcome": "internal"}) == 1
    assert client.xpending(stream, "scoring")["pending"] == 0


@pytest.mark.timeout(30)
def test_kv_rejection_and_per_sequence_errors(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    enqueue(client, stream, "kv", reply, [{"tokens": [1, 14, 3], "prompt_len": 1}], temperature=0.5)
    enqueue(client, stream, "long", reply, [
        {"tokens": [1, 2, 3], "prompt_len": 1}, {"tokens": list(range(1, 10)), "prompt_len": 1},
    ])  # fmt: skip
    enqueue(client, stream, "fine", reply, [{"tokens": [1, 2, 3], "prompt_len": 1}])
    worker, _ = _run(redis_url, stream, max_jobs=3)
    results, _ = collect(client, reply, ["kv", "long", "fine"], timeout=5)
    assert results["kv"].code == "internal"
    assert results["long"].code == "too_long" and results["long"].error["message"].startswith(
        "seqs[1]"
    )
    assert results["fine"].ok
    reg = worker.metrics.registry
    assert reg.get_sample_value("scoring_kv_outputs_rejected_total") == 1
    assert reg.get_sample_value("scoring_kv_output_bytes_total") == 4096  # the rejected bytes


@pytest.mark.timeout(30)
def test_batches_respect_token_budget_and_group_by_mode(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    ids = []
    for i in range(12):
        mode = "reward" if i % 3 == 0 else "reference"
        enqueue(
            client, stream, f"b{i}", reply, [{"tokens": [1, 2, 3, 4], "prompt_len": 1}], mode=mode
        )
        ids.append(f"b{i}")
    worker, scorer = _run(redis_url, stream, max_jobs=12, max_batch_tokens=16)
    results, dups = collect(client, reply, ids, timeout=5)
    assert dups == 0 and all(r.ok for r in results.values())
    assert all(n * 4 <= 16 for n in scorer.calls)  # each call within the token budget
    assert sum(scorer.calls) == 12
    for i in range(12):  # each job was scored in its own mode
        res = results[f"b{i}"]
        assert (res.seqs[0].reward is not None) == (i % 3 == 0)
        assert (res.seqs[0].logps is not None) == (i % 3 != 0)
    reg = worker.metrics.registry
    assert reg.get_sample_value("scoring_batches_total") == len(scorer.calls)
    assert reg.get_sample_value("scoring_queue_wait_seconds_count") == 12
    assert reg.get_sample_value("scoring_end_to_end_seconds_count") == 12


@pytest.mark.timeout(30)
def test_burst_exits_when_drained(redis_url: str, key_prefix: str, cleanup_keys: None) -> None:
    client = redis.Redis.from_url(redis_url)
    parts = keys.job_streams(key_prefix, 2)
    reply = keys.reply_stream(parts[0], "c")
    ids = [f"p{i}" for i in range(6)]
    for i, job_id in enumerate(ids):
        enqueue(client, parts[i % 2], job_id, reply, [{"tokens": [1, 2, 3], "prompt_len": 1}])
    scorer = ScriptedScorer()
    config = WorkerConfig(
        streams=tuple(parts), consumer="burst", metrics_port=None, burst=True, block_ms=50
    )
    worker = Worker(
        config, RedisSettings(url=redis_url), scorer, metrics=WorkerMetrics(CollectorRegistry())
    )
    assert worker.run() == 0
    assert worker.jobs_done == 6
    results, _ = collect(client, reply, ids, timeout=2)
    assert all(r.ok for r in results.values())
    assert all(client.xpending(s, "scoring")["pending"] == 0 for s in parts)


@pytest.mark.timeout(30)
def test_load_time_fallback_is_counted_and_reported(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    from worker.scorer import FallbackEvent

    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    enqueue(client, stream, "fb", reply, [{"tokens": [1, 2, 3], "prompt_len": 1}])
    scorer = ScriptedScorer()
    scorer.load_fallbacks = [  # type: ignore[attr-defined]
        FallbackEvent("flash_attention_2", "sdpa", "not_installed", "no flash-attn", "load"),
        FallbackEvent("packed", "padded", "no_packing", "rows disagree", "load"),
    ]
    config = WorkerConfig(streams=(stream,), consumer="fb", metrics_port=None, max_jobs=1)
    worker = Worker(
        config, RedisSettings(url=redis_url), scorer, metrics=WorkerMetrics(CollectorRegistry())
    )
    assert worker.run() == 0
    results, _ = collect(client, reply, ["fb"], timeout=2)
    info = results["fb"].info
    assert info["fallback"] is True
    assert info["fallback_reason"] == "flash_attention_2->sdpa: not_installed (at load)"
    labels = {"requested": "flash_attention_2", "used": "sdpa", "reason": "not_installed"}
    reg = worker.metrics.registry
    assert reg.get_sample_value("scoring_attention_fallbacks_total", labels) == 1


@pytest.mark.parametrize(("batch_timeout_s", "alive_during_batch"), [(60.0, True), (0.2, False)])
@pytest.mark.timeout(30)
def test_long_batch_keeps_liveness_until_batch_timeout(
    redis_url: str,
    key_prefix: str,
    cleanup_keys: None,
    batch_timeout_s: float,
    alive_during_batch: bool,
) -> None:
    import threading
    import time

    from worker.observability.health import HealthState

    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    enqueue(client, stream, "slow", reply, [{"tokens": [1, 2, 3], "prompt_len": 1}])
    health = HealthState(stall_after_s=0.5)
    config = WorkerConfig(
        streams=(stream,),
        consumer="live",
        metrics_port=None,
        max_jobs=1,
        claim_idle_ms=300,
        batch_timeout_s=batch_timeout_s,
    )
    worker = Worker(
        config,
        RedisSettings(url=redis_url),
        NoopScorer(delay_ms=1500),
        metrics=WorkerMetrics(CollectorRegistry()),
        health=health,
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    seen: list[bool] = []
    while thread.is_alive():
        if worker.batch_started_s is not None and time.monotonic() - worker.batch_started_s > 0.8:
            seen.append(health.liveness()[0])
        time.sleep(0.05)
    thread.join()
    assert seen, "the batch was never observed running"
    assert all(seen) if alive_during_batch else not any(seen[-3:])
    results, _ = collect(client, reply, ["slow"], timeout=2)
    assert results["slow"].ok
