"""Worker heartbeats against the real Redis: key layout (one slot per queue), what a beat writes
and ``read_heartbeats`` returns, expiry of a worker that stops beating, and ``scoring-worker
info`` listing the live workers of a queue with what each holds (an in-process worker)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry

from tests.support.daemon import enqueue
from worker import keys, streams
from worker.cli import main
from worker.config import RedisSettings
from worker.daemon import Worker
from worker.daemon.config import WorkerConfig
from worker.daemon.heartbeat import Heartbeat, heartbeat_ttl_s
from worker.daemon.stats import StatsSampler
from worker.observability.metrics import WorkerMetrics
from worker.scorer.noop import NoopScorer

pytestmark = pytest.mark.redis

HELD = {
    "adapters": {
        "run42/step-120": {"bytes": 3 << 20, "fingerprint": "0123456789abcdef"},
        "other": {"bytes": 1 << 20, "fingerprint": "fedcba9876543210"},
    },
    "versions": {"step-2": {"bytes": 10 << 20, "fingerprint": "aaaabbbbccccdddd"}},
    "bytes": 14 << 20,
    "budget": {"adapters": 8, "versions": 1, "bytes": 0},
}


class HoldingScorer(NoopScorer):
    """A noop scorer that reports resident weights, as the executor does."""

    def resident(self) -> dict[str, Any]:
        return HELD


def test_heartbeat_keys_share_the_queue_slot() -> None:
    for queue, parts in (("ref-7b", 1), ("ref-7b", 4)):
        index = keys.workers_index(queue)
        beat = keys.worker_heartbeat(queue, "pod-{odd}-1")
        assert keys.hash_tag(index) == keys.hash_tag(beat) == queue
        assert keys.same_slot(index, beat)
        assert {keys.queue_of(s) for s in keys.job_streams(queue, parts)} == {queue}
    assert keys.queue_of("my:custom:stream") is None
    assert keys.queue_of("scoring:{q:x}:jobs") is None


def test_noop_scorer_holds_nothing() -> None:
    assert NoopScorer().resident() == {}


def test_write_and_read_heartbeats(redis_url: str, key_prefix: str, cleanup_keys: None) -> None:
    client = redis.Redis.from_url(redis_url)
    fields = {"model": "m", "dtype": "float32", "resident": HELD, "modes": ["reference"]}
    streams.write_heartbeat(client, key_prefix, "w2", fields, ttl_s=30)
    streams.write_heartbeat(client, key_prefix, "w1", {"model": "noop", "resident": {}}, 30)
    beats = streams.read_heartbeats(client, key_prefix)
    assert [b["consumer"] for b in beats] == ["w1", "w2"]
    w2 = beats[1]
    assert w2["model"] == "m" and w2["resident"] == HELD and w2["modes"] == ["reference"]
    assert 25 < w2["ttl_s"] <= 30 and abs(float(w2["updated_at"]) - time.time()) < 5
    assert beats[0]["resident"] == {}
    assert 0 < client.pttl(keys.worker_heartbeat(key_prefix, "w1")) <= 30_000
    assert streams.read_heartbeats(client, key_prefix + "x") == []


def test_a_worker_that_stops_beating_drops_out(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    client = redis.Redis.from_url(redis_url)
    streams.write_heartbeat(client, key_prefix, "gone", {"model": "m"}, ttl_s=0.2)
    streams.write_heartbeat(client, key_prefix, "alive", {"model": "m"}, ttl_s=30)
    time.sleep(0.4)
    assert [b["consumer"] for b in streams.read_heartbeats(client, key_prefix)] == ["alive"]


def test_stats_step_writes_the_heartbeat_and_survives_a_refusal(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix, 2)
    for s in stream:
        client.xgroup_create(s, "scoring", id="0", mkstream=True)
    metrics = WorkerMetrics(CollectorRegistry())
    beat = Heartbeat(
        tuple(stream),
        group="scoring",
        consumer="gpu-3",
        scorer=HoldingScorer(),
        ttl_s=heartbeat_ttl_s(5.0),
    )
    assert beat.queues == (key_prefix,) and beat.ttl_s == 15.0
    sampler = StatsSampler(
        tuple(stream),
        "scoring",
        metrics=metrics,
        heartbeat=beat,
        dead_stream_of=keys.dead_letter_stream,
        interval_s=5.0,
    )
    sampler.sample(client)
    (got,) = streams.read_heartbeats(client, key_prefix)
    assert got["consumer"] == "gpu-3" and got["group"] == "scoring" and got["model"] == "noop"
    assert got["resident"] == HELD
    # a key of the wrong type refuses HSET (WRONGTYPE): logged and counted, the step goes on
    client.delete(keys.worker_heartbeat(key_prefix, "gpu-3"))
    client.set(keys.worker_heartbeat(key_prefix, "gpu-3"), "x")
    sampler.sample(client)
    assert (
        metrics.registry.get_sample_value("scoring_loop_errors_total", {"where": "heartbeat"}) == 1
    )


@pytest.mark.timeout(60)
def test_info_lists_live_workers_with_what_they_hold(
    redis_url: str, key_prefix: str, cleanup_keys: None, capsys: pytest.CaptureFixture[str]
) -> None:
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    enqueue(client, stream, "j0", reply, [{"tokens": [1, 2, 3], "prompt_len": 1}])
    config = WorkerConfig(
        streams=(stream,),
        consumer="gpu-7",
        metrics_port=None,
        max_jobs=1,
        block_ms=100,
        claim_idle_ms=5000,
    )
    worker = Worker(
        config,
        RedisSettings(url=redis_url),
        HoldingScorer(),
        metrics=WorkerMetrics(CollectorRegistry()),
    )
    assert worker.run() == 0
    streams.write_heartbeat(client, key_prefix, "gpu-1", {"model": "noop", "resident": {}}, 30)
    assert main(["info", "--redis-url", redis_url, "--queue", key_prefix, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    workers = {w["consumer"]: w for w in info["workers"]}
    assert set(workers) == {"gpu-1", "gpu-7"}
    assert workers["gpu-7"]["resident"] == HELD and workers["gpu-7"]["model"] == "noop"
    assert workers["gpu-7"]["ttl_s"] > 0 and workers["gpu-1"]["resident"] == {}
    assert main(["info", "--redis-url", redis_url, "--queue", key_prefix]) == 0
    text = capsys.readouterr().out
    assert "WORKER" in text and "gpu-7" in text and "2 adapters, 1 versions, 14.0 MiB" in text
    assert "adapter run42/step-120  3.0 MiB  fingerprint 0123456789abcdef" in text
    assert "version step-2  10.0 MiB  fingerprint aaaabbbbccccdddd" in text
