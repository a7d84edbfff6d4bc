"""The client with real workers (``python -m worker serve`` subprocesses): a tiny random Llama saved
with ``save_pretrained`` (scores checked against a naive forward), typed errors produced by the
worker, and backpressure under a slow (noop, delayed) worker measured from the stream side."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from tests.support.client import OutstandingSampler
from tests.support.daemon import WorkerProc
from worker import keys
from worker.client import (
    BadRequestError,
    ExpiredError,
    ScoringClient,
    TooLongError,
    UnsupportedModeError,
)
from worker.client.aio import AsyncScoringClient

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def _cleanup(url: str, prefix: str) -> None:
    r = redis.Redis.from_url(url)
    for key in r.scan_iter(match=f"*{prefix}*", count=1000):
        r.delete(key)


@pytest.fixture(scope="module")
def llama_worker(
    machine_redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, str]]:
    """(redis url, queue, model dir) with a reference-only worker serving a tiny Llama."""
    from tests.support.models import tiny_causal

    root = tmp_path_factory.mktemp("e2e")
    tiny_causal("llama", seed=0).save_pretrained(root / "ref")
    queue = f"e2e{uuid.uuid4().hex[:10]}"
    worker = WorkerProc(
        [
            "--redis-url", machine_redis_url, "--queue", queue, "--partitions", "2",
            "--reference-model", str(root / "ref"), "--device", "cpu", "--metrics-port", "-1",
            "--block-ms", "100",
        ],
        root / "worker.log",
    )  # fmt: skip
    try:
        worker.wait_ready(120)
        yield machine_redis_url, queue, str(root / "ref")
    finally:
        worker.stop()
        _cleanup(machine_redis_url, queue)


def _naive_logps(model_dir: str, tokens: list[int], prompt_len: int) -> np.ndarray:
    """log_softmax(logits).gather(next token) for the completion, one plain forward."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([tokens]), use_cache=False).logits[0].float()  # [T, V]
    logp = torch.log_softmax(logits[:-1], dim=-1)  # [T-1, V]
    picked = logp.gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]  # [T-1]
    return picked[prompt_len - 1 :].numpy()


@pytest.mark.timeout(180)
def test_sync_and_async_scores_match_a_naive_forward(llama_worker: tuple[str, str, str]) -> None:
    url, queue, model_dir = llama_worker
    a = [int(x) for x in np.random.default_rng(0).integers(1, 96, 19)]
    b = [int(x) for x in np.random.default_rng(1).integers(1, 96, 11)]
    with ScoringClient(url, queue=queue, partitions=2) as client:
        scores = client.score([(a, 5), {"tokens": np.array(b), "prompt_len": 3}], timeout=60)

    async def main() -> list:
        async with AsyncScoringClient(url, queue=queue, partitions=2) as c:
            return [r async for r in c.score_many([[(a, 5)], [(b, 3)]], max_in_flight=2)]

    async_results = asyncio.run(main())
    want_a, want_b = _naive_logps(model_dir, a, 5), _naive_logps(model_dir, b, 3)
    np.testing.assert_allclose(scores[0].logps, want_a, atol=1e-4)
    np.testing.assert_allclose(scores[1].logps, want_b, atol=1e-4)
    np.testing.assert_allclose(async_results[0].seqs[0].logps, want_a, atol=1e-4)
    np.testing.assert_allclose(async_results[1].seqs[0].logps, want_b, atol=1e-4)
    assert async_results[0].info["attention_backend"]


@pytest.mark.timeout(120)
def test_worker_errors_arrive_as_typed_exceptions(llama_worker: tuple[str, str, str]) -> None:
    url, queue, _ = llama_worker
    with ScoringClient(url, queue=queue, partitions=2) as client:
        cases = {
            client.submit([([1, 2, 500], 1)]): BadRequestError,  # token id outside the vocab
            client.submit([(list(range(1, 90)) * 4, 1)]): TooLongError,  # 356 > 256 positions
            client.submit([([1, 2, 3], 1)], mode="reward"): UnsupportedModeError,
            client.submit([([1, 2, 3], 1)], expires_in_s=-5): ExpiredError,
        }
        for handle, cls in cases.items():
            with pytest.raises(cls) as info:
                client.result(handle, timeout=60)
            assert info.value.job_id == handle.job_id and info.value.reason
        # the worker keeps serving after all that
        assert len(client.score([([1, 2, 3], 1)], timeout=60)[0].logps) == 2


@pytest.mark.timeout(120)
def test_backpressure_under_a_slow_real_worker(
    machine_redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    url = machine_redis_url
    streams = keys.job_streams(key_prefix)
    worker = WorkerProc(
        ["--redis-url", url, "--queue", key_prefix, "--scorer", "noop", "--noop-delay-ms", "30",
         "--metrics-port", "-1", "--block-ms", "100", "--max-batch-tokens", "4"],
        tmp_path / "worker.log",
    )  # fmt: skip
    try:
        worker.wait_ready(60)
        jobs = [[([1, 2, 3, i + 4], 1)] for i in range(30)]
        with (
            ScoringClient(url, queue=key_prefix) as client,
            OutstandingSampler(url, streams) as sampler,
        ):
            start = time.monotonic()
            results = list(client.score_many(jobs, max_in_flight=5, ordered=False, timeout=60))
            elapsed = time.monotonic() - start
        assert len(results) == 30
        assert {int(r.seqs[0].logps.size) for r in results} == {3}
        assert 3 <= sampler.peak <= 5, (sampler.peak, sampler.samples)
        assert elapsed > 30 * 0.03 * 0.8  # the worker really was the bottleneck
    finally:
        worker.stop()
        _cleanup(url, key_prefix)
