"""Duplicate suppression and reply-stream cleanup with a real worker (``python -m worker serve
--scorer noop`` subprocess, no model): a job answered twice is seen once, ``close()`` deletes the
reply stream, or leaves it with a TTL while results may still arrive."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.support.client import outstanding
from tests.support.daemon import WorkerProc, enqueue, wait_until
from worker import keys, protocol
from worker.client import JobSpec, ScoreResult, ScoringClient, ScoringTimeout
from worker.client.aio import AsyncScoringClient

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(120)]


def _cleanup(url: str, queue: str) -> None:
    r = redis.Redis.from_url(url)
    for key in r.scan_iter(match=f"*{queue}*", count=1000):
        r.delete(key)


@pytest.fixture(scope="module")
def noop_worker(
    machine_redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """(redis url, queue) served by one noop worker."""
    queue = f"dd{uuid.uuid4().hex[:10]}"
    log_path = tmp_path_factory.mktemp("dedupe") / "worker.log"
    worker = WorkerProc(
        ["--redis-url", machine_redis_url, "--queue", queue, "--scorer", "noop",
         "--metrics-port", "-1", "--block-ms", "100"],
        log_path,
    )  # fmt: skip
    try:
        worker.wait_ready(90)
        yield machine_redis_url, queue
        assert "Traceback" not in worker.log()
    finally:
        worker.stop()
        _cleanup(machine_redis_url, queue)


def _seqs(i: int) -> list[dict[str, Any]]:
    return [{"tokens": [1, 2, 3, 4 + i], "prompt_len": 2}]


def test_a_job_answered_twice_is_yielded_once(noop_worker: tuple[str, str]) -> None:
    """Every job reaches the queue twice (a producer retry or a redelivery: the worker scores it
    twice and writes two results); score_many yields each job once and counts the rest."""
    url, queue = noop_worker
    r = redis.Redis.from_url(url)
    n = 8
    ids = [f"dup-{uuid.uuid4().hex[:8]}-{i}" for i in range(n)]
    with ScoringClient(url, queue=queue, block_ms=200) as client:

        def jobs() -> Iterator[JobSpec]:
            for i, job_id in enumerate(ids):
                if i:  # job i-1 is on the queue by now: put it there a second time
                    prev = ids[i - 1]
                    enqueue(r, client.stream_for(prev), prev, client.reply_stream, _seqs(i - 1))
                yield JobSpec(_seqs(i), job_id=job_id)
            enqueue(r, client.stream_for(ids[-1]), ids[-1], client.reply_stream, _seqs(n - 1))

        results = list(client.score_many(jobs(), max_in_flight=3, ordered=False, timeout=60))
        assert sorted(res.job_id for res in results) == sorted(ids)  # each job exactly once
        assert all(len(res.seqs[0].logps) == 2 for res in results)
        wait_until(lambda: client.duplicates >= n, 30, what="the second results")
        assert client.duplicates == n
        with pytest.raises(ScoringTimeout):
            client.result(ids[0], timeout=0.3)  # delivered once, never again
        assert client.outstanding == 0 and client.late_results == 0
        assert client._buffer.ready == {}
        wait_until(lambda: r.exists(client.reply_stream), 5)
    # nothing was left outstanding, so close() deleted the reply stream
    assert not r.exists(client.reply_stream)


def test_async_copies_of_a_real_result_are_dropped(noop_worker: tuple[str, str]) -> None:
    """A worker's real result payload for a job, written again to the client's reply stream
    (before and after the client took the first copy), never reaches the caller twice."""
    url, queue = noop_worker
    r = redis.Redis.from_url(url)
    job_id = f"copy-{uuid.uuid4().hex[:8]}"
    stream = keys.job_streams(queue)[0]
    scratch = keys.reply_stream(stream, f"scratch-{uuid.uuid4().hex[:8]}")
    enqueue(r, stream, job_id, scratch, _seqs(0))
    reply = r.xread({scratch: "0-0"}, block=30_000)
    assert reply, "the worker did not answer"
    real_payload = reply[0][1][0][1][protocol.PAYLOAD_FIELD]
    assert protocol.decode_result(real_payload).id == job_id

    async def main() -> tuple[AsyncScoringClient, ScoreResult]:
        async with AsyncScoringClient(url, queue=queue, block_ms=200) as client:
            handle = await client.submit(_seqs(0), job_id=job_id)
            r.xadd(client.reply_stream, {protocol.PAYLOAD_FIELD: real_payload})
            result = await client.result(handle, timeout=30)
            r.xadd(client.reply_stream, {protocol.PAYLOAD_FIELD: real_payload})
            for _ in range(1000):
                if client.duplicates >= 2:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(ScoringTimeout):
                await client.result(job_id, timeout=0.3)  # delivered once, never again
            assert client.outstanding == 0
            return client, result

    client, result = asyncio.run(main())
    assert result.job_id == job_id and len(result.seqs[0].logps) == 2
    # of the three results (the worker's, a copy before and a copy after the first was taken)
    # exactly one was delivered
    assert client.duplicates == 2
    r.delete(scratch)
    assert not r.exists(client.reply_stream)


def test_close_with_jobs_in_flight_leaves_a_ttl_for_late_results(
    noop_worker: tuple[str, str],
) -> None:
    url, queue = noop_worker
    r = redis.Redis.from_url(url)
    streams = keys.job_streams(queue)
    client = ScoringClient(url, queue=queue, reply_ttl_s=50, block_ms=200)
    client.submit(_seqs(1))  # never waited for
    forgotten = client.submit(_seqs(2))
    client.forget(forgotten)
    client.close()
    assert 0 < r.ttl(client.reply_stream) <= 50
    # the worker answers after the close: the results land in the key that has the TTL
    wait_until(lambda: outstanding(r, streams) == 0, 30, what="the worker to answer")
    assert r.exists(client.reply_stream)
    assert 0 < r.ttl(client.reply_stream) <= 50
    r.delete(client.reply_stream)
