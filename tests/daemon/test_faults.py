"""Failure handling of subprocess workers: poison input, deadlines, max deliveries, kill -9,
lease renewal under a slow batch, SIGTERM drain, Redis connections killed mid-run.

The poison/deadline/max-deliveries tests (one shared worker per server), kill -9 reclaim and the
CLIENT KILL recovery run against both the machine's Redis 7 and the embedded Valkey."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import redis

from tests.support.daemon import (
    WorkerProc,
    collect,
    enqueue,
    kill9_reclaim_scenario,
    metric,
    pending_of,
    wait_until,
)
from worker import keys, streams
from worker.protocol import decode_result

pytestmark = [pytest.mark.redis, pytest.mark.slow]
GROUP = "scoring"


def noop_args(url: str, queue: str, consumer: str, *extra: str) -> list[str]:
    return ["--redis-url", url, "--queue", queue, "--consumer", consumer, "--scorer", "noop",
            "--metrics-port", "0", *extra]  # fmt: skip


def _cleanup(client: redis.Redis, prefix: str) -> None:
    for key in client.scan_iter(match=f"*{prefix}*", count=1000):
        client.delete(key)


# ----------------------------------------------------------------------------- one shared worker


SERVERS = ["redis7", "valkey9"]  # the ids of conftest's any_redis_url


@pytest.fixture(scope="module")
def poison_workers(
    machine_redis_url: str, valkey_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[WorkerProc, redis.Redis, str]]]:
    """One noop worker per server (Redis 7, embedded Valkey) with small limits, short claim idle
    and max_deliveries=2; both start at once so their start-up times overlap."""
    urls = {"redis7": machine_redis_url, "valkey9": valkey_url}
    base = f"poison{int(time.time() * 1000) % 10**9}"
    started: dict[str, tuple[WorkerProc, redis.Redis, str]] = {}
    try:
        for name, url in urls.items():
            queue = f"{base}-{name}"
            log = tmp_path_factory.mktemp(f"poison-{name}") / "worker.log"
            worker = WorkerProc(
                noop_args(url, queue, "pw", "--max-seqs-per-job", "8",
                          "--max-tokens-per-job", "1000", "--max-deliveries", "2",
                          "--claim-idle-ms", "300"),
                log,
            )  # fmt: skip
            started[name] = (worker, redis.Redis.from_url(url), queue)
        for worker, _, _ in started.values():
            worker.wait_ready()
        yield started
    finally:
        for worker, client, queue in started.values():
            worker.stop()
            _cleanup(client, queue)


@pytest.fixture(params=SERVERS)
def poison_worker(
    request: pytest.FixtureRequest,
    poison_workers: dict[str, tuple[WorkerProc, redis.Redis, str]],
) -> tuple[WorkerProc, redis.Redis, str]:
    """The shared poison worker of one server (the test runs once per server)."""
    return poison_workers[request.param]


@pytest.mark.timeout(60)
def test_poison_payloads_get_error_results_or_dead_letter(
    poison_worker: tuple[WorkerProc, redis.Redis, str],
) -> None:
    worker, client, queue = poison_worker
    stream = keys.job_streams(queue)[0]
    reply = keys.reply_stream(stream, "poison")
    dead = keys.dead_letter_stream(stream)
    wrong_type_reply = keys.reply_stream(stream, "not-a-stream")
    client.set(wrong_type_reply, "x")

    def raw(body: object) -> None:
        client.xadd(stream, {"payload": msgpack.packb(body, use_bin_type=True)})

    good_seq = {"tokens": [1, 2, 3], "prompt_len": 1}
    client.xadd(stream, {"payload": b"\xc1garbage bytes"})  # no reply_to: dead letter
    client.xadd(stream, {"something": b"else"})  # no payload field: dead letter
    raw({"v": 1, "id": "types", "mode": "reference", "reply_to": reply, "seqs": "nope"})
    raw({"v": 2, "id": "version", "mode": "reference", "reply_to": reply, "seqs": [good_seq]})
    raw(
        {"v": 1, "id": "many-seqs", "mode": "reference", "reply_to": reply, "seqs": [good_seq] * 20}
    )
    raw({"v": 1, "id": "many-tokens", "mode": "reference", "reply_to": reply,
         "seqs": [{"tokens": list(range(1, 2001)), "prompt_len": 1}]})  # fmt: skip
    raw({"v": 1, "id": "vocab", "mode": "reference", "reply_to": reply,
         "seqs": [{"tokens": [1, 2, 40000], "prompt_len": 1}]})  # fmt: skip
    raw({"v": 1, "id": "mode", "mode": "sample", "reply_to": reply, "seqs": [good_seq]})
    raw({"v": 1, "id": "mask", "mode": "reference", "reply_to": reply,
         "seqs": [{"tokens": [1, 2, 3], "mask": b"\x01\x01\x01"}]})  # fmt: skip
    raw({"v": 1, "id": "no-reply", "mode": "reference", "seqs": [good_seq]})
    enqueue(client, stream, "unwritable", wrong_type_reply, [good_seq])
    enqueue(client, stream, "good", reply, [good_seq], meta={"k": [1, 2]})

    ids = ["types", "version", "many-seqs", "many-tokens", "vocab", "mode", "mask", "good"]
    results, dups = collect(client, reply, ids, timeout=30)
    assert dups == 0
    for job_id in ids[:-1]:
        assert not results[job_id].ok
    assert {results[i].code for i in ("types", "version", "many-seqs", "many-tokens")} == {
        "bad_request"
    }
    assert results["vocab"].code == "bad_request"
    assert results["mode"].code in ("bad_request", "unsupported_mode")
    assert results["mask"].code == "bad_request"
    assert results["good"].ok and results["good"].meta == {"k": [1, 2]}

    def dead_reasons() -> list[str]:
        return [f[b"reason"].decode() for _, f in client.xrange(dead)]

    wait_until(lambda: len(dead_reasons()) >= 4, 10, what="dead letters")
    reasons = dead_reasons()
    assert sum(r.startswith("no_reply_to") for r in reasons) == 2  # garbage, no reply_to
    assert sum(r.startswith("undecodable") for r in reasons) == 1  # no payload field
    assert sum(r.startswith("reply_failed") for r in reasons) == 1  # WRONGTYPE reply key
    wait_until(lambda: pending_of(client, stream, GROUP) == 0, 10, what="everything acked")
    assert worker.proc.poll() is None
    url = worker.metrics_url
    assert metric(url, "scoring_jobs_total", '{outcome="bad_request"}') >= 6
    assert metric(url, "scoring_dead_lettered_total", '{reason="no_reply_to"}') == 2


@pytest.mark.timeout(60)
def test_deadline_passed_gets_expired(poison_worker: tuple[WorkerProc, redis.Redis, str]) -> None:
    _worker, client, queue = poison_worker
    stream = keys.job_streams(queue)[0]
    reply = keys.reply_stream(stream, "deadline")
    now_ms = int(time.time() * 1000)
    seq = [{"tokens": [1, 2, 3], "prompt_len": 1}]
    enqueue(client, stream, "late", reply, seq, deadline_ms=now_ms - 1000)
    enqueue(client, stream, "in-time", reply, seq, deadline_ms=now_ms + 60_000)
    results, _ = collect(client, reply, ["late", "in-time"], timeout=20)
    assert results["late"].code == "expired"
    assert results["in-time"].ok


@pytest.mark.timeout(60)
def test_max_deliveries_dead_letters_and_tells_the_producer(
    poison_worker: tuple[WorkerProc, redis.Redis, str],
) -> None:
    worker, client, queue = poison_worker
    stream = keys.job_streams(queue)[0]
    reply = keys.reply_stream(stream, "maxdel")
    dead = keys.dead_letter_stream(stream)
    payload = msgpack.packb(
        {
            "v": 1,
            "id": "crashy",
            "mode": "reference",
            "reply_to": reply,
            "seqs": [{"tokens": [1, 2, 3], "prompt_len": 1}],
        },
        use_bin_type=True,
    )
    # Deliver it to a "ghost" consumer atomically (the worker cannot read it first), then bump
    # its delivery count as two crashed workers would have.
    pipe = client.pipeline(transaction=True)
    pipe.xadd(stream, {"payload": payload})
    pipe.xreadgroup(GROUP, "ghost", {stream: ">"}, count=1)
    entry_id = pipe.execute()[0].decode()
    client.xclaim(stream, GROUP, "ghost", 0, [entry_id])  # delivery 2 (the worker's claim: 3)
    results, _ = collect(client, reply, ["crashy"], timeout=20)
    assert results["crashy"].code == "dead_letter"
    assert "delivered 3 times" in results["crashy"].error["message"]
    wait_until(
        lambda: any(f[b"id"].decode() == entry_id for _, f in client.xrange(dead)),
        10,
        what="dead letter entry",
    )
    row = next(f for _, f in client.xrange(dead) if f[b"id"].decode() == entry_id)
    assert row[b"reason"].startswith(b"max_deliveries") and row[b"payload"] == payload
    assert int(row[b"deliveries"]) == 3
    wait_until(lambda: pending_of(client, stream, GROUP) == 0, 10, what="ack")
    assert worker.proc.poll() is None


# ----------------------------------------------------------------------------- dying workers


@pytest.mark.timeout(90)
def test_kill9_mid_batch_every_job_still_answered(
    any_redis_url: str, key_prefix: str, cleanup_keys: None, tmp_path: Path
) -> None:
    kill9_reclaim_scenario(any_redis_url, key_prefix, tmp_path, jobs=40)


@pytest.mark.timeout(90)
def test_slow_batch_keeps_its_lease_and_second_signal_exits_at_once(
    redis_url: str, key_prefix: str, cleanup_keys: None, tmp_path: Path
) -> None:
    """A 3 s batch with --claim-idle-ms 500: a thief running XAUTOCLAIM never gets the entry."""
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    worker = WorkerProc(
        noop_args(
            redis_url, key_prefix, "owner", "--noop-delay-ms", "3000", "--claim-idle-ms", "500"
        ),
        tmp_path / "w.log",
    )
    try:
        worker.wait_ready()
        enqueue(client, stream, "long", reply, [{"tokens": [1, 2, 3], "prompt_len": 1}])
        wait_until(lambda: pending_of(client, stream, GROUP, "owner") == 1, 10, what="read")
        stolen = 0
        t_end = time.monotonic() + 2.5
        while time.monotonic() < t_end:
            claimed, _ = streams.reclaim_idle(
                client, stream, GROUP, "thief", min_idle_ms=500, count=10, use_autoclaim=True
            )
            stolen += len(claimed)
            time.sleep(0.1)
        assert stolen == 0
        results, dups = collect(client, reply, ["long"], timeout=20)
        assert results["long"].ok and results["long"].info["worker"] == "owner"
        assert dups == 0
        assert metric(worker.metrics_url, "scoring_leases_renewed_total") >= 3
        # a second signal during a drain exits at once; the held entry stays pending
        enqueue(client, stream, "abandoned", reply, [{"tokens": [1, 2, 3], "prompt_len": 1}])
        wait_until(lambda: pending_of(client, stream, GROUP, "owner") == 1, 10, what="read")
        time.sleep(0.3)  # its batch started (read but not started, it would be handed back)
        t0 = time.monotonic()
        worker.signal(signal.SIGTERM)
        worker.wait_log(r"draining \(SIGTERM\)", 5)
        worker.signal(signal.SIGTERM)
        assert worker.wait_exit(10) == 1
        assert time.monotonic() - t0 < 2.5  # before the 3 s batch could have finished
        assert pending_of(client, stream, GROUP, "owner") == 1
    finally:
        worker.stop()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("handback", [True, False], ids=["handback", "no-handback"])
def test_sigterm_drains_in_flight_batch_and_exits_0(
    redis_url: str, key_prefix: str, cleanup_keys: None, tmp_path: Path, handback: bool
) -> None:
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    worker = WorkerProc(
        noop_args(redis_url, key_prefix, "drainer", "--noop-delay-ms", "1500",
                  "--max-batch-tokens", "12", *(() if handback else ("--no-handback",))),
        tmp_path / "w.log",
    )  # fmt: skip
    try:
        worker.wait_ready()
        ids = [f"d{i}" for i in range(10)]
        for job_id in ids:
            enqueue(client, stream, job_id, reply, [{"tokens": [1, 2, 3, 4], "prompt_len": 2}])
        wait_until(lambda: pending_of(client, stream, GROUP, "drainer") > 0, 10, what="read")
        time.sleep(0.3)  # the first batch computes (1.5 s)
        t0 = time.monotonic()
        worker.signal(signal.SIGTERM)
        assert worker.wait_exit(30) == 0
        assert time.monotonic() - t0 < 20
        answered = {decode_result(f[b"payload"]).id for _, f in client.xrange(reply)}
        assert answered, "the in-flight batch was written before exit"
        # whatever was not answered was handed back (pending, claimable at once, delivery not
        # counted) or never read: it is still waiting for others
        info = streams.stream_stats(client, stream, GROUP)
        rows = client.xpending_range(stream, GROUP, "-", "+", 100, consumername="drainer")
        assert all(r["times_delivered"] == 0 for r in rows)
        assert all(r["time_since_delivered"] > 24 * 3600 * 1000 for r in rows)
        assert len(answered) + len(rows) + (info["lag"] or 0) == len(ids)
        if handback:
            assert len(answered) <= 6  # the computing batch (3 jobs), and one more at most
        else:
            assert rows == []
        assert "draining (SIGTERM)" in worker.log()
    finally:
        worker.stop()


@pytest.mark.timeout(90)
def test_redis_connections_killed_and_stream_deleted_recovery(
    any_redis_url: str, key_prefix: str, cleanup_keys: None, tmp_path: Path
) -> None:
    redis_url = any_redis_url
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    worker = WorkerProc(
        noop_args(redis_url, key_prefix, f"rk-{key_prefix}", "--claim-idle-ms", "1000",
                  "--block-ms", "200"),
        tmp_path / "w.log",
    )  # fmt: skip
    seq = [{"tokens": [1, 2, 3], "prompt_len": 1}]
    try:
        worker.wait_ready()
        first = [f"a{i}" for i in range(20)]
        for job_id in first:
            enqueue(client, stream, job_id, reply, seq)
        collect(client, reply, first, timeout=20)
        name = f"scoring-worker:rk-{key_prefix}"
        killed = 0
        for _ in range(3):  # kill every connection of the worker a few times, mid-run
            for c in client.client_list():
                if c.get("name") == name:
                    client.client_kill_filter(_id=c["id"])
                    killed += 1
            enqueue(client, stream, f"mid{killed}", reply, seq)
            time.sleep(0.3)
        assert killed >= 3
        client.delete(stream)  # Redis "came back empty": the group is gone (NOGROUP)
        second = [f"b{i}" for i in range(20)]
        for job_id in second:
            enqueue(client, stream, job_id, reply, seq)
        results, _ = collect(client, reply, second, timeout=30)
        assert all(results[i].ok for i in second)
        assert worker.proc.poll() is None
        assert "recreating" in worker.log()
    finally:
        worker.stop()
