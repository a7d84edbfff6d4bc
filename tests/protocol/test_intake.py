"""Payloads that break a protocol limit or rule, end to end against a real Redis: the worker reads
their ``id``/``reply_to`` (without decoding the rest) and answers ``bad_request`` to the producer,
acks the entry and dead-letters nothing. Covers the size limit (``--max-payload-bytes``) and the
strict decoding rules of ``docs/protocol.md`` (map keys, ext types, UTF-8, tokens encoding).
"""

from __future__ import annotations

import datetime
import signal
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from prometheus_client import CollectorRegistry

from tests.support.daemon import WorkerProc, collect, pending_of, wait_until
from worker import keys
from worker.config import RedisSettings
from worker.daemon import Worker
from worker.daemon.config import WorkerConfig
from worker.observability.metrics import WorkerMetrics
from worker.protocol import Limits, encode_job
from worker.scorer.noop import NoopScorer

pytestmark = pytest.mark.redis

MAX_PAYLOAD = 4096


def _tokens(n: int) -> bytes:
    return struct.pack(f"<{n}i", *([1] * n))


def _body(job_id: str, reply: str, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "v": 1,
        "id": job_id,
        "mode": "reference",
        "reply_to": reply,
        "seqs": [{"tokens": _tokens(3), "prompt_len": 1}],
    }
    body.update(over)
    return body


def _cases(reply: str) -> dict[str, tuple[bytes, str]]:
    """job id -> (payload, a fragment of the expected bad_request message)."""
    big_seqs = [{"tokens": _tokens(2000), "prompt_len": 1}]  # 8000 bytes > MAX_PAYLOAD
    # Keys in an unusual order: the oversized value comes before id, reply_to and meta.
    back = {"seqs": big_seqs, "v": 1, "mode": "reference", "id": "big-back", "reply_to": reply}
    back["meta"] = {"k": "back"}
    now = datetime.datetime.now(datetime.UTC)
    return {
        "big-front": (
            encode_job("big-front", "reference", reply, big_seqs, meta={"k": "front"}),
            f"over the limit of {MAX_PAYLOAD}",
        ),
        "big-back": (msgpack.packb(back, use_bin_type=True), f"over the limit of {MAX_PAYLOAD}"),
        "int-key-meta": (
            msgpack.packb(_body("int-key-meta", reply, meta={1: "a"}), use_bin_type=True),
            "map keys must be str or bin",
        ),
        "ext-meta": (
            msgpack.packb(
                _body("ext-meta", reply, meta=msgpack.ExtType(5, b"xy")), use_bin_type=True
            ),
            "ext types",
        ),
        "timestamp-meta": (
            msgpack.packb(
                _body("timestamp-meta", reply, meta=now), use_bin_type=True, datetime=True
            ),
            "timestamps",
        ),
        "raw-tokens": (  # the old msgpack "raw" encoding: bytes packed as str
            msgpack.packb(_body("raw-tokens", reply), use_bin_type=False),
            "tokens must be int32 bin",
        ),
        "long-str": (
            msgpack.packb(_body("long-str", reply, note="x" * 300), use_bin_type=True),
            "a str is longer than 256 bytes",
        ),
    }


@pytest.mark.timeout(60)
def test_limit_and_rule_breakers_get_bad_request_in_process(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    cases = _cases(reply)
    for payload, _ in cases.values():
        client.xadd(stream, {"payload": payload})
    # A valid job whose meta float is float32 on the wire: echoed as float64.
    ok_payload = msgpack.packb(_body("ok", reply, meta={"x": 0.5}), use_single_float=True)
    assert b"\xca" in ok_payload
    client.xadd(stream, {"payload": ok_payload})

    limits = Limits(max_payload_bytes=MAX_PAYLOAD, max_meta_bytes=256)
    config = WorkerConfig(
        streams=(stream,),
        consumer="inproc",
        metrics_port=None,
        max_jobs=len(cases) + 1,
        block_ms=100,
        claim_idle_ms=5000,
        limits=limits,
    )
    metrics = WorkerMetrics(CollectorRegistry())
    worker = Worker(config, RedisSettings(url=redis_url), NoopScorer(), metrics=metrics)
    assert worker.run() == 0

    results, dups = collect(client, reply, [*cases, "ok"], timeout=10)
    assert dups == 0
    for job_id, (_payload, needle) in cases.items():
        res = results[job_id]
        assert res.code == "bad_request", (job_id, res.error)
        assert needle in res.error["message"], (job_id, res.error)
    # meta is echoed when it is itself readable, also from an oversized payload.
    assert results["big-front"].meta == {"k": "front"}
    assert results["big-back"].meta == {"k": "back"}
    assert results["int-key-meta"].meta is None and results["ext-meta"].meta is None
    assert results["ok"].ok and results["ok"].meta == {"x": 0.5}
    raw = [f[b"payload"] for _i, f in client.xrange(reply)]
    ok_raw = next(p for p in raw if msgpack.unpackb(p)["id"] == "ok")
    assert b"\xcb\x3f\xe0\x00\x00\x00\x00\x00\x00" in ok_raw  # 0.5 as float64
    assert pending_of(client, stream, "scoring") == 0
    assert client.xlen(keys.dead_letter_stream(stream)) == 0
    reg = metrics.registry
    assert reg.get_sample_value("scoring_jobs_total", {"outcome": "bad_request"}) == len(cases)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_max_payload_bytes_flag_answers_bad_request(
    redis_url: str, key_prefix: str, cleanup_keys: None, tmp_path: Path
) -> None:
    """``serve --max-payload-bytes`` (a subprocess worker): an over-limit job gets ``bad_request``
    with the size message at its reply_to and is acked; a job under the limit is scored."""
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    worker = WorkerProc(
        ["--redis-url", redis_url, "--stream", stream, "--scorer", "noop", "--metrics-port", "-1",
         "--block-ms", "200", "--max-payload-bytes", str(MAX_PAYLOAD), "--max-jobs", "2"],
        tmp_path / "worker.log",
    )  # fmt: skip
    try:
        worker.wait_ready()
        big = encode_job("big", "reference", reply, [{"tokens": [1] * 2000, "prompt_len": 1}])
        assert len(big) > MAX_PAYLOAD
        client.xadd(stream, {"payload": big})
        small = encode_job("small", "reference", reply, [{"tokens": [1, 2, 3], "prompt_len": 1}])
        client.xadd(stream, {"payload": small})
        results, _ = collect(client, reply, ["big", "small"], timeout=30)
        assert results["big"].code == "bad_request"
        assert results["big"].error["message"] == (
            f"payload is {len(big)} bytes, over the limit of {MAX_PAYLOAD}"
        )
        assert results["small"].ok
        wait_until(lambda: pending_of(client, stream, "scoring") == 0, 10, what="acks")
        assert client.xlen(keys.dead_letter_stream(stream)) == 0
        assert worker.wait_exit(30) == 0  # --max-jobs 2
        assert "Traceback" not in worker.log()
    finally:
        if worker.proc.poll() is None:
            worker.signal(signal.SIGTERM)
        worker.stop()
