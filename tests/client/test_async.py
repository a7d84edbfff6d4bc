"""The asyncio client against the real Redis, with a worker test double (client logic)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
import redis

from tests.support.client import OutstandingSampler, Responder, expected_logps
from worker import keys
from worker.client import DeadLetterError, JobFailed, ScoringTimeout
from worker.client import window as window_mod
from worker.client.aio import AsyncScoringClient

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30), pytest.mark.usefixtures("cleanup_keys")]


def test_async_score(redis_url: str, key_prefix: str) -> None:
    toks = [10, 11, 12, 13]

    async def main() -> list:
        async with AsyncScoringClient(redis_url, queue=key_prefix) as client:
            return await client.score([{"tokens": toks, "prompt_len": 1}], timeout=10)

    with Responder(redis_url, keys.job_streams(key_prefix)):
        scores = asyncio.run(main())
    np.testing.assert_allclose(scores[0].logps, expected_logps(toks, 1), rtol=1e-6)


@pytest.mark.parametrize("ordered", [True, False])
def test_async_score_many_is_bounded(redis_url: str, key_prefix: str, ordered: bool) -> None:
    streams = keys.job_streams(key_prefix, 2)

    async def jobs():  # an async source works as well as a list
        for i in range(30):
            yield {"seqs": [([1, 2, i + 3], 1)], "meta": {"i": i}}

    async def main() -> list:
        async with AsyncScoringClient(redis_url, queue=key_prefix, partitions=2) as client:
            return [
                r
                async for r in client.score_many(
                    jobs(), max_in_flight=3, ordered=ordered, timeout=10
                )
            ]

    with (
        Responder(redis_url, streams, delay_s=0.01, count=1),
        OutstandingSampler(redis_url, streams) as sampler,
    ):
        results = asyncio.run(main())
    assert len(results) == 30
    metas = [r.meta["i"] for r in results]
    if ordered:
        assert metas == list(range(30))
    else:
        assert sorted(metas) == list(range(30))
    assert 2 <= sampler.peak <= 3, sampler.peak


def test_async_errors_timeouts_duplicates_and_cleanup(redis_url: str, key_prefix: str) -> None:
    r = redis.Redis.from_url(redis_url)

    async def main() -> tuple[AsyncScoringClient, JobFailed, ScoringTimeout, int]:
        client = AsyncScoringClient(redis_url, queue=key_prefix)
        h = await client.submit([([1, 2, 3], 1)], meta={"fail": "dead_letter"})
        try:
            await client.result(h, timeout=5)
        except JobFailed as exc:
            failed = exc
        h2 = await client.submit([([1, 2, 3], 1)], meta={"drop": True})
        start = time.monotonic()
        try:
            await client.result(h2, timeout=0.2)
        except ScoringTimeout as exc:
            timeout = exc
        assert time.monotonic() - start < 2
        h3 = await client.submit([([1, 2, 3], 1)], meta={"dup": 2})
        await client.result(h3, timeout=5)
        for _ in range(100):
            if client.duplicates == 2:
                break
            await asyncio.sleep(0.01)
        dups = client.duplicates
        await client.close()
        return client, failed, timeout, dups

    with Responder(redis_url, keys.job_streams(key_prefix)):
        client, failed, timeout, dups = asyncio.run(main())
    assert isinstance(failed, DeadLetterError) and failed.code == "dead_letter"
    assert timeout.job_id in str(timeout) and "0.2 s" in str(timeout)
    assert dups == 2
    # h2 never got an answer, so the stream is left to expire rather than deleted
    assert 0 < r.ttl(client.reply_stream) <= client.reply_ttl_s


@pytest.mark.parametrize("ordered", [True, False])
def test_async_score_many_without_timeout_waits_across_slices(
    redis_url: str, key_prefix: str, ordered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(window_mod, "_WAIT_SLICE_S", 0.02)
    waits: list[float | None] = []

    async def main() -> list:
        async with AsyncScoringClient(redis_url, queue=key_prefix) as client:
            real_wait_any = client._core.wait_any

            def counting_wait_any(job_ids: Any, timeout: float | None) -> Any:
                waits.append(timeout)
                return real_wait_any(job_ids, timeout)

            monkeypatch.setattr(client._core, "wait_any", counting_wait_any)
            jobs = [{"seqs": [([1, 2, 3], 1)], "meta": {"i": i}} for i in range(2)]
            return [
                r
                async for r in client.score_many(
                    jobs, max_in_flight=2, ordered=ordered, timeout=None
                )
            ]

    with Responder(redis_url, keys.job_streams(key_prefix), delay_s=0.4, count=1):
        out = asyncio.run(main())
    assert sorted(r.meta["i"] for r in out) == [0, 1]
    assert len(waits) > 5
    assert all(w is not None and w <= 0.02 for w in waits)


def test_async_timeouts_report_the_wait_and_forget_jobs(redis_url: str, key_prefix: str) -> None:
    r = redis.Redis.from_url(redis_url)

    async def main() -> tuple[AsyncScoringClient, ScoringTimeout, float, ScoringTimeout]:
        client = AsyncScoringClient(redis_url, queue=key_prefix, reply_ttl_s=40)
        jobs = [{"seqs": [([1, 2, 3], 1)], "meta": {"drop": True}}, [([1, 2, 3], 1)]]
        start = time.monotonic()
        try:
            async for _ in client.score_many(jobs, max_in_flight=2, timeout=0.3):
                pass
        except ScoringTimeout as exc:
            many_timeout = exc
        elapsed = time.monotonic() - start
        assert client.outstanding == 0  # the dropped job was forgotten with the iterator
        # a late result of a job whose score() timed out is dropped on arrival
        try:
            await client.score([([1, 2, 3], 1)], meta={"slow": True}, timeout=0.05)
        except ScoringTimeout as exc:
            score_timeout = exc
        assert client.outstanding == 0
        for _ in range(300):
            if client.late_results:
                break
            await asyncio.sleep(0.01)
        assert client.late_results == 1 and client._buffer.ready == {}
        await client.close()
        return client, many_timeout, elapsed, score_timeout

    with Responder(redis_url, keys.job_streams(key_prefix), delay_s=0.2):
        client, many_timeout, elapsed, score_timeout = asyncio.run(main())
    assert 0.3 <= many_timeout.waited_s <= elapsed + 0.01
    assert f"after waiting {many_timeout.waited_s:.1f} s" in str(many_timeout)
    assert score_timeout.waited_s >= 0.05
    # the dropped job of score_many never got an answer: the stream is left to expire
    assert 0 < r.ttl(client.reply_stream) <= 40
