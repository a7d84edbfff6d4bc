"""Teacher outputs through a real worker (real Redis, the daemon with a tiny-model executor):
a producer writing raw msgpack from docs/protocol.md alone decodes every new array; bad options
get bad_request with the reason and the worker keeps serving; the clients return numpy arrays;
old jobs get byte-identical results."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import msgpack
import numpy as np
import pytest
import redis
from prometheus_client import CollectorRegistry

from tests.support.models import random_tokens, tiny_causal
from worker import keys
from worker.client import ScoringClient
from worker.client.aio import AsyncScoringClient
from worker.config import RedisSettings
from worker.daemon import Worker
from worker.daemon.config import WorkerConfig
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.observability.metrics import WorkerMetrics
from worker.scorer import ScoreOptions
from worker.scorer.noop import NoopScorer
from worker.scorer.teacher import Sampling, TokenOutputs

pytestmark = pytest.mark.redis


def _worker(url: str, stream: str, scorer: Any, **cfg: Any) -> tuple[Worker, threading.Thread]:
    config = WorkerConfig(
        streams=(stream,),
        consumer=f"c{uuid.uuid4().hex[:6]}",
        metrics_port=None,
        block_ms=50,
        claim_idle_ms=5000,
        max_wait_ms=1,
        **cfg,
    )
    worker = Worker(
        config, RedisSettings(url=url), scorer, metrics=WorkerMetrics(CollectorRegistry())
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return worker, thread


def _group_made(url: str, stream: str, timeout_s: float = 30.0) -> None:
    """Wait until the worker started in a thread has created its consumer group on ``stream``."""
    import time

    import redis

    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if client.exists(stream) and client.xinfo_groups(stream):
                return
            time.sleep(0.02)
    finally:
        client.close()
    raise AssertionError(f"no consumer group on {stream} after {timeout_s} s")


def _stop(worker: Worker, thread: threading.Thread) -> None:
    worker.request_stop()
    thread.join(30)


def _raw_job(job_id: str, reply: str, seqs: list[dict], **keys_: Any) -> bytes:
    """A job exactly as docs/protocol.md spells it: a msgpack map, bin for arrays."""
    body = {"v": 1, "id": job_id, "mode": keys_.pop("mode", "reference"), "reply_to": reply}
    body["seqs"] = seqs
    body.update(keys_)
    return msgpack.packb(body, use_bin_type=True)


def _read(client: redis.Redis, reply: str, n: int, timeout_s: float = 60.0) -> dict[str, dict]:
    """Raw result maps by job id (msgpack only, no worker code)."""
    got: dict[str, dict] = {}
    last = "0"
    import time

    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        for _, entries in client.xread({reply: last}, block=200) or []:
            for eid, fields in entries:
                last = eid
                body = msgpack.unpackb(fields[b"payload"], raw=False)
                got[body["id"]] = body
    assert len(got) == n, f"got {sorted(got)}"
    return got


def _decode(body: dict, k: int) -> dict[str, np.ndarray]:
    """Every array of seqs[k] from the result's layout map alone (docs/protocol.md)."""
    entry = body["seqs"][k]
    out = {"logps": np.frombuffer(entry["logps"], "<f4")} if "logps" in entry else {}
    for name, (dtype, width) in body.get("layout", {}).items():
        value = np.frombuffer(entry[name], dtype)
        out[name] = value if width == 1 else value.reshape(-1, width)
    return out


@pytest.fixture(scope="module")
def executor() -> StatelessExecutor:
    return StatelessExecutor(ExecutorConfig(), tiny_causal("llama"))


@pytest.mark.timeout(120)
def test_raw_producer_decodes_every_array_and_bad_options_get_bad_request(
    redis_url: str, key_prefix: str, cleanup_keys: None, executor: StatelessExecutor
) -> None:
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "raw")
    t1, t2 = random_tokens(20, 1), random_tokens(9, 2)
    mask = bytes([0, 0, 1, 1, 0, 1, 1, 1, 0])  # two scored segments: 5 positions
    per_pos = [np.arange(16 * 3, dtype="<i4").reshape(16, 3) % 96, np.full((5, 3), 7, "<i4")]
    seqs = [
        {
            "tokens": np.array(t1, "<i4").tobytes(),
            "prompt_len": 4,
            "gather_ids": per_pos[0].tobytes(),
        },
        {"tokens": np.array(t2, "<i4").tobytes(), "mask": mask, "gather_ids": per_pos[1].tobytes()},
    ]
    sampling = {"top_k": 20, "top_p": 0.9, "min_p": 0.0}
    teacher = {
        "outputs": ["logps", "entropy", "topk", "gather", "processed_logps"],
        "topk": 8,
        "sampling": sampling,
        "temperature": 0.8,
    }
    plain_seqs = [{k: v for k, v in s.items() if k != "gather_ids"} for s in seqs]
    bad = {
        "k0": dict(teacher, topk=0),
        "k300": dict(teacher, topk=300),
        "unknown": dict(teacher, outputs=["logps", "logits"]),
        "samp": dict(teacher, sampling={"top_p": 1.5}),
        "reward": {"outputs": ["entropy"], "mode": "reward"},
        "vocab": {"outputs": ["gather"], "gather_ids": [1, 96]},
        "shape": {"outputs": ["gather"]},  # seqs carry 3 ids per position: fine; see below
        "huge": {"outputs": ["topk"], "topk": 256},
    }
    jobs = {
        name: _raw_job(name, reply, plain_seqs if name in ("vocab", "huge") else seqs, **kw)
        for name, kw in bad.items()
    }
    jobs["shape"] = _raw_job(
        "shape", reply, [dict(seqs[0], gather_ids=b"\0" * 4 * 5)], outputs=["gather"]
    )
    jobs["good"] = _raw_job("good", reply, seqs, **teacher)
    jobs["half"] = _raw_job("half", reply, plain_seqs, outputs=["topk", "gather"], topk=4,
                            gather_ids=[0, 5, 95], float16=True)  # fmt: skip
    jobs["old"] = _raw_job("old", reply, plain_seqs, temperature=0.8)
    for payload in jobs.values():
        client.xadd(stream, {b"payload": payload})
    worker, thread = _worker(redis_url, stream, executor, max_result_bytes=21 * 256 * 8)
    try:
        got = _read(client, reply, len(jobs))
    finally:
        _stop(worker, thread)
    messages = {name: got[name].get("error", {}).get("message", "") for name in bad}
    for name in bad:
        code = "too_large" if name == "huge" else "bad_request"  # the result-size refusal
        assert got[name]["ok"] is False and got[name]["error"]["code"] == code, name
    assert "topk k must be an integer in 1..256, got 0" in messages["k0"]
    assert "1..256, got 300" in messages["k300"]
    assert "unknown" in messages["unknown"] and "logits" in messages["unknown"]
    assert "sampling.top_p must be in (0, 1]" in messages["samp"]
    assert "need mode reference or both" in messages["reward"]
    assert "outside the vocabulary 0..95" in messages["vocab"]
    assert "5 ids for 16 scored tokens" in messages["shape"]
    assert f"over this worker's limit of {21 * 256 * 8} bytes" in messages["huge"]
    assert "split the job" in messages["huge"]
    # the good job: every array decoded from the layout map, equal to the executor's own
    good = got["good"]
    assert good["ok"] and set(good["layout"]) == {
        "entropy",
        "topk_ids",
        "topk_logps",
        "topk_tail_logp",
        "gather_logps",
        "processed_logps",
    }
    spec = TokenOutputs(
        ("logps", "entropy", "topk", "gather", "processed_logps"),
        topk=8,
        gather_width=3,
        sampling=Sampling(**sampling),
    )
    inputs = [
        SequenceInput(t1, prompt_len=4, gather_ids=per_pos[0]),
        SequenceInput(t2, mask=mask, gather_ids=per_pos[1]),
    ]
    want = executor.score(inputs, temperature=0.8, options=ScoreOptions(outputs=spec)).scores
    for k, ref in enumerate(want):
        arrays = _decode(good, k)
        np.testing.assert_array_equal(arrays["logps"], ref.logps)
        for name, value in (ref.arrays or {}).items():
            np.testing.assert_array_equal(arrays[name], value)
        assert arrays["topk_ids"].dtype == np.int32 and arrays["topk_ids"].shape == (
            len(ref.logps),
            8,
        )
    # float16 travels as <f2, half the bytes; no logps asked, none sent
    half = got["half"]
    assert half["layout"] == {
        "topk_ids": ["<i4", 4],
        "topk_logps": ["<f2", 4],
        "topk_tail_logp": ["<f4", 1],
        "gather_logps": ["<f2", 3],
    }
    assert "logps" not in half["seqs"][0] and len(half["seqs"][0]["topk_logps"]) == 16 * 4 * 2
    # an old job: no layout, the same keys as ever
    assert "layout" not in got["old"] and set(got["old"]["seqs"][0]) == {"logps"}
    reg = worker.metrics.registry
    assert reg.get_sample_value("scoring_outputs_requested_total", {"output": "topk"}) == 2
    assert reg.get_sample_value("scoring_outputs_requested_total", {"output": "logps"}) == 2
    assert reg.get_sample_value("scoring_result_bytes_count") == 3


@pytest.mark.timeout(60)
def test_clients_return_numpy_arrays_and_old_results_are_byte_identical(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    stream = keys.job_streams(key_prefix)[0]
    worker, thread = _worker(redis_url, stream, NoopScorer(vocab_size=100))
    seqs = [
        {"tokens": [1, 2, 3, 4, 5], "prompt_len": 2, "gather_ids": np.ones((3, 2), np.int32)},
        {"tokens": [5, 6, 7], "mask": [0, 1, 1], "gather_ids": [[1, 2], [3, 4]]},
    ]
    try:
        with ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True) as c:
            scores = c.score(
                seqs,
                outputs=("logps", "entropy", "topk", "gather"),
                topk=4,
                float16=True,
                timeout=30,
            )
            plain = c.score([(s["tokens"], 1) for s in seqs], timeout=30)

        async def run() -> Any:
            async with AsyncScoringClient(
                redis_url, queue=key_prefix, wait_for_unknown_queue=True
            ) as ac:
                return await ac.score([([1, 2, 3], 1)], outputs=("entropy",), timeout=30)

        async_scores = asyncio.run(run())
    finally:
        _stop(worker, thread)
    first = scores[0]
    assert first.logps.dtype == np.float32 and first.logps.shape == (3,)
    assert first.entropy.shape == (3,) and first.topk_ids.dtype == np.int32
    assert first.topk_ids.shape == (3, 4) and first.topk_logps.dtype == np.float16
    assert first.gather_logps.shape == (3, 2) and scores[1].gather_logps.shape == (2, 2)
    assert first.topk_tail_logp.dtype == np.float32
    assert plain[0].entropy is None and plain[0].topk_ids is None
    assert async_scores[0].logps is None and async_scores[0].entropy.shape == (2,)
    assert set(first.to_json()) >= {"logps", "entropy", "topk_ids", "gather_logps"}


@pytest.mark.timeout(120)
def test_distillation_example_runs_against_a_real_worker(
    redis_url: str, key_prefix: str, cleanup_keys: None, executor: StatelessExecutor
) -> None:
    """docs/examples/distill.py, as docs/distillation.md runs it, against a tiny-model worker."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs" / "examples" / "distill.py"
    spec = importlib.util.spec_from_file_location("distill_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    stream = keys.job_streams(key_prefix)[0]
    worker, thread = _worker(redis_url, stream, executor)
    try:
        _group_made(redis_url, stream)  # the example's client refuses a queue nobody serves yet
        losses = example.main(["--redis-url", redis_url, "--queue", key_prefix, "--vocab", "96"])
    finally:
        _stop(worker, thread)
    assert set(losses) == {"reverse_kl", "topk_forward_kl", "gather"}
    assert all(np.isfinite(v) for v in losses.values())
    assert losses["topk_forward_kl"] > 0 and losses["gather"] > 0  # KLs of distinct models
    # the top-k forward KL with its tail bucket is exact when k covers the vocabulary
    lp = example.log_softmax(np.random.default_rng(0).normal(size=(5, 8)))
    lq = example.log_softmax(np.random.default_rng(1).normal(size=(5, 8)))
    ids = np.argsort(-lp, axis=1)[:, :8]
    full = (np.exp(lp) * (lp - lq)).sum(1)
    got = example.topk_forward_kl(ids, np.take_along_axis(lp, ids, 1), np.full(5, -np.inf), lq)
    np.testing.assert_allclose(got, full, atol=1e-9)
