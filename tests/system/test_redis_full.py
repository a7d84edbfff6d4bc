"""A full Redis (``noeviction`` at ``maxmemory``) refuses jobs, and producers are told at once:
``QueueFullError`` from the client (``submit``, ``score``, ``score_groups``, ``score_many``;
sync and asyncio), exit 3 from ``enqueue``, 503 ``queue_full`` with ``Retry-After`` from the
gateway. Nothing is half-written (one ``XADD`` per job: every entry carries its payload, no
reply stream key is left behind), every job a producer was told was written is scored once
memory frees, and the same producer carries on. Against a ``redis-server`` of this module's own
with a small ``maxmemory``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests

from tests.faults.servers import RedisServer, have_redis_server
from tests.support.daemon import ROOT, thread_worker, wait_until
from tests.support.gateway import GatewayThread
from worker import keys, streams
from worker.client import JobFailed, QueueFullError, ScoringClient
from worker.client.aio import AsyncScoringClient
from worker.protocol import PAYLOAD_FIELD, decode_job
from worker.scorer.noop import NoopScorer

pytestmark = [
    pytest.mark.redis,
    pytest.mark.slow,
    pytest.mark.skipif(not have_redis_server(), reason="redis-server not installed"),
]
TOKENS = list(range(3000))  # about 9 KB a job: a few dozen fill the room left
SEQS = [{"tokens": TOKENS, "prompt_len": 5}]
ROOM_BYTES = 512 << 10


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as srv:
        yield srv


def _queue(admin: redis.Redis, queue: str) -> str:
    """The queue's job stream with its consumer group (a known queue), before memory is short."""
    stream = keys.job_streams(queue)[0]
    streams.ensure_group(admin, stream, keys.DEFAULT_GROUP)
    return stream


def _fill_to(admin: redis.Redis, room: int = ROOM_BYTES) -> None:
    """``maxmemory`` set ``room`` bytes above what the server uses now (policy noeviction)."""
    used = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory", used + room)


def _written(admin: redis.Redis, stream: str) -> list[str]:
    """The job ids in ``stream``; every entry has exactly its payload and decodes."""
    ids = []
    for _, fields in admin.xrange(stream):
        assert set(fields) == {PAYLOAD_FIELD}
        ids.append(decode_job(fields[PAYLOAD_FIELD]).id)
    return ids


def _all_answered(admin: redis.Redis, stream: str) -> bool:
    """Every entry of ``stream`` was read by the group and acked."""
    (group,) = admin.xinfo_groups(stream)
    return bool(group["lag"] == 0 and group["pending"] == 0)


def test_the_client_gets_queue_full_at_once_and_carries_on(server: RedisServer) -> None:
    admin = server.admin()
    stream = _queue(admin, "full")
    _fill_to(admin)
    with ScoringClient(server.url, queue="full") as client:
        handles = []
        with pytest.raises(QueueFullError) as info:
            for _ in range(10_000):
                handles.append(client.submit(SEQS))
        err = info.value
        assert isinstance(err, JobFailed) and err.code == "queue_full" and err.sent is False
        assert "OOM" in str(err) and "nothing of it was written" in str(err)
        assert 5 < len(handles) < 10_000
        # nothing half-written: one entry with its payload per job it was told went in, the
        # refused job nowhere, and no key but the job stream (no reply stream written yet)
        assert _written(admin, stream) == [h.job_id for h in handles]
        assert err.job_id not in {h.job_id for h in handles}
        assert {k.decode() for k in admin.keys("*")} == {stream}
        # a producer closed while the server is full leaves no reply stream behind
        other = ScoringClient(server.url, queue="full")
        with pytest.raises(QueueFullError):
            other.submit(SEQS)
        other.close()
        assert {k.decode() for k in admin.keys("*")} == {stream}
        # every other way in is refused at once too
        start = time.monotonic()
        with pytest.raises(QueueFullError):
            client.score(SEQS, timeout=60)
        with pytest.raises(QueueFullError):
            client.score_groups([1, 2, 3], [TOKENS], timeout=60)
        with pytest.raises(QueueFullError) as many:
            list(client.score_many([SEQS] * 4, max_in_flight=4, raise_errors=False))
        assert time.monotonic() - start < 5
        assert many.value.written == 0 and many.value.in_flight == ()
        assert len(_written(admin, stream)) == len(handles)

        # some room: score_many writes what fits, stops cleanly and says how many went in
        _fill_to(admin, 96 << 10)
        with pytest.raises(QueueFullError) as many:
            list(client.score_many([SEQS] * 1000, max_in_flight=1000, timeout=60))
        went_in = many.value.written
        assert went_in > 0 and len(many.value.in_flight) == went_in
        assert f"{went_in} of its jobs were written" in str(many.value)
        assert len(_written(admin, stream)) == len(handles) + went_in

        # memory frees: every job told written is scored, and the producer carries on
        admin.config_set("maxmemory", 0)
        with thread_worker(server.url, "full", NoopScorer()):
            for handle in handles:
                assert len(client.result(handle, timeout=60).seqs) == 1
            assert len(client.score(SEQS, timeout=60)) == 1
            assert [len(r.seqs) for r in client.score_many([SEQS] * 3, timeout=60)] == [1, 1, 1]
            wait_until(lambda: _all_answered(admin, stream), 30, 0.1, "every entry answered")


def test_the_asyncio_client_gets_queue_full_too(server: RedisServer) -> None:
    admin = server.admin()
    _queue(admin, "afull")
    _fill_to(admin)

    async def flood() -> tuple[int, QueueFullError]:
        async with AsyncScoringClient(server.url, queue="afull") as client:
            written = 0
            try:
                for _ in range(10_000):
                    await client.submit(SEQS)
                    written += 1
            except QueueFullError as exc:
                with pytest.raises(QueueFullError):
                    await client.score(SEQS, timeout=60)
                with pytest.raises(QueueFullError):
                    await client.score_groups([1, 2, 3], [TOKENS], timeout=60)
                with pytest.raises(QueueFullError) as many:
                    async for _ in client.score_many([SEQS] * 3, max_in_flight=3):
                        pass
                assert many.value.written == 0
                return written, exc
        raise AssertionError("never refused")

    written, err = asyncio.run(flood())
    assert written > 5 and err.code == "queue_full" and not err.sent


def _enqueue(url: str, src: Path, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "worker", "enqueue", "--redis-url", url, "--queue", "efull",
         "--file", str(src), "--out", str(out), "--max-in-flight", "1000", "--timeout", "60",
         "--no-progress"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=180, check=False,
    )  # fmt: skip


def test_enqueue_stops_says_what_went_in_and_resumes(server: RedisServer, tmp_path: Path) -> None:
    admin = server.admin()
    stream = _queue(admin, "efull")
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = 200
    src.write_text(
        "".join(json.dumps({"tokens": TOKENS, "prompt_len": 5}) + "\n" for _ in range(lines))
    )
    _fill_to(admin)
    first = _enqueue(server.url, src, out)
    assert first.returncode == 3, first.stderr
    assert "is full" in first.stderr and "re-run the same command" in first.stderr
    written = len(_written(admin, stream))
    assert 0 < written < lines
    assert f"this run wrote {written} jobs" in first.stderr
    assert f"(line {written + 1})" in first.stderr  # the refused line: where a re-run starts
    assert out.read_text() == ""  # no worker yet: nothing answered

    admin.config_set("maxmemory", 0)
    with thread_worker(server.url, "efull", NoopScorer()):
        second = _enqueue(server.url, src, out)
        assert second.returncode == 0, second.stderr
        wait_until(lambda: _all_answered(admin, stream), 30, 0.1, "every entry answered")
    done = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(d["id"] for d in done) == sorted(f"line-{n}" for n in range(1, lines + 1))
    assert all(d["ok"] for d in done)


def test_the_gateway_answers_503_with_retry_after_and_carries_on(server: RedisServer) -> None:
    admin = server.admin()
    stream = _queue(admin, "gfull")
    body = {"prompt": [TOKENS], "prompt_logprobs": 0}
    with GatewayThread(server.url, "gfull", window_ms=1, timeout_s=60) as gateway:
        _fill_to(admin, 64 << 10)
        for _ in range(200):  # fill what room is left; then the refusal
            r = requests.post(gateway.url + "/v1/completions", json=body, timeout=1)
            if r.status_code == 503:
                break
        else:
            raise AssertionError("the gateway never answered 503")
        assert r.json()["error"]["code"] == "queue_full", r.text
        assert r.headers["retry-after"] == "10" and r.headers["x-scoring-error"] == "queue_full"
        for _, fields in admin.xrange(stream):  # nothing half-written
            assert set(fields) == {PAYLOAD_FIELD}
        admin.config_set("maxmemory", 0)
        with thread_worker(server.url, "gfull", NoopScorer()):
            r = requests.post(gateway.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            wait_until(lambda: _all_answered(admin, stream), 30, 0.1, "every entry answered")
