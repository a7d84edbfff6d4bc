"""worker.streams against real servers (Redis 7 and Valkey 9): groups, reads over partitions,
atomic result+ack, lease renewal without stealing, reclaim with delivery counts, stats."""

from __future__ import annotations

import time

import pytest
import redis

from worker import keys, streams
from worker.daemon.leases import InFlight

pytestmark = pytest.mark.redis
G = "scoring"


@pytest.fixture
def client(any_redis_url: str, key_prefix: str):  # type: ignore[no-untyped-def]
    c = redis.Redis.from_url(any_redis_url)
    yield c
    for key in c.scan_iter(match=f"*{key_prefix}*", count=1000):
        c.delete(key)


def test_ensure_group_tolerates_only_busygroup(client: redis.Redis, key_prefix: str) -> None:
    stream = keys.job_streams(key_prefix)[0]
    assert streams.ensure_group(client, stream, G) is True
    assert streams.ensure_group(client, stream, G) is False
    wrong = f"{stream}:string"
    client.set(wrong, "x")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        streams.ensure_group(client, wrong, G)


def test_read_new_covers_every_partition(client: redis.Redis, key_prefix: str) -> None:
    parts = keys.job_streams(key_prefix, 3)
    for s in parts:
        streams.ensure_group(client, s, G)
        client.xadd(s, {"payload": s.encode()})
    got = streams.read_new(client, parts, G, "c1", count=10, block_ms=100, rotation=1)
    assert sorted(e.stream for e in got) == sorted(parts)
    assert all(e.payload == e.stream.encode() and e.deliveries == 1 for e in got)
    assert all(abs(e.enqueued_ms - time.time() * 1000) < 60_000 for e in got)
    assert streams.read_new(client, parts, G, "c1", count=10, block_ms=None) == []


def test_write_results_acks_only_written_results(client: redis.Redis, key_prefix: str) -> None:
    stream = keys.job_streams(key_prefix)[0]
    streams.ensure_group(client, stream, G)
    good_reply = keys.reply_stream(stream, "ok")
    bad_reply = keys.reply_stream(stream, "bad")
    client.set(bad_reply, "not a stream")
    for _ in range(2):
        client.xadd(stream, {"payload": b"j"})
    e1, e2 = streams.read_new(client, [stream], G, "c1", count=10, block_ms=None)
    failures = streams.write_results(
        client,
        G,
        [
            streams.Delivery(stream, e1.id, good_reply, b"r1"),
            streams.Delivery(stream, e2.id, bad_reply, b"r2"),
        ],
        maxlen=100,
    )
    assert [(d.entry_id, "WRONGTYPE" in err) for d, err in failures] == [(e2.id, True)]
    assert [f[b"payload"] for _, f in client.xrange(good_reply)] == [b"r1"]
    pending = client.xpending_range(stream, G, "-", "+", 10)
    assert [p["message_id"].decode() for p in pending] == [e2.id]  # unwritten stays pending


def test_reply_streams_are_trimmed(client: redis.Redis, key_prefix: str) -> None:
    stream = keys.job_streams(key_prefix)[0]
    streams.ensure_group(client, stream, G)
    reply = keys.reply_stream(stream, "trim")
    for _ in range(300):
        client.xadd(stream, {"payload": b"j"})
    entries = streams.read_new(client, [stream], G, "c1", count=300, block_ms=None)
    deliveries = [streams.Delivery(stream, e.id, reply, b"r") for e in entries]
    assert streams.write_results(client, G, deliveries, maxlen=50) == []
    assert client.xlen(reply) < 300  # approximate trimming (whole radix nodes)
    assert client.xpending(stream, G)["pending"] == 0


def test_renew_leases_resets_idle_but_never_steals(client: redis.Redis, key_prefix: str) -> None:
    stream = keys.job_streams(key_prefix)[0]
    streams.ensure_group(client, stream, G)
    client.xadd(stream, {"payload": b"a"})
    client.xadd(stream, {"payload": b"b"})
    mine = streams.read_new(client, [stream], G, "me", count=1, block_ms=None)[0]
    theirs = streams.read_new(client, [stream], G, "other", count=1, block_ms=None)[0]
    time.sleep(0.25)
    renewed = streams.renew_leases(client, stream, G, "me", [mine.id, theirs.id])
    assert renewed == [mine.id]
    rows = {r["message_id"].decode(): r for r in client.xpending_range(stream, G, "-", "+", 10)}
    assert rows[mine.id]["time_since_delivered"] < 200 and rows[mine.id]["times_delivered"] == 1
    assert rows[theirs.id]["consumer"] == b"other"
    assert rows[theirs.id]["time_since_delivered"] >= 200


def test_reclaim_idle_bumps_delivery_count_and_reports_deleted(
    client: redis.Redis, key_prefix: str
) -> None:
    stream = keys.job_streams(key_prefix)[0]
    streams.ensure_group(client, stream, G)
    ids = [client.xadd(stream, {"payload": b"x"}).decode() for _ in range(3)]
    streams.read_new(client, [stream], G, "dead", count=3, block_ms=None)
    client.xdel(stream, ids[2])
    # nothing is idle enough yet; XAUTOCLAIM still drops the deleted entry from the PEL
    assert streams.reclaim_idle(
        client, stream, G, "alive", min_idle_ms=60_000, count=10, use_autoclaim=True
    ) == ([], [ids[2]])
    time.sleep(0.15)
    claimed, deleted = streams.reclaim_idle(
        client, stream, G, "alive", min_idle_ms=100, count=10, use_autoclaim=True
    )
    assert [e.id for e in claimed] == ids[:2] and deleted == []
    assert [e.deliveries for e in claimed] == [2, 2]
    time.sleep(0.15)
    claimed, _ = streams.reclaim_idle(  # the XPENDING + XCLAIM path of older servers
        client, stream, G, "other", min_idle_ms=100, count=10, use_autoclaim=False
    )
    assert [e.id for e in claimed] == ids[:2]
    assert [e.deliveries for e in claimed] == [3, 3]


def test_dead_letter_moves_and_acks(client: redis.Redis, key_prefix: str) -> None:
    stream = keys.job_streams(key_prefix)[0]
    dead = keys.dead_letter_stream(stream)
    streams.ensure_group(client, stream, G)
    client.xadd(stream, {"payload": b"\x00bad"})
    entry = streams.read_new(client, [stream], G, "c1", count=1, block_ms=None)[0]
    streams.dead_letter(client, G, entry, dead, reason="no_reply_to: x", consumer="c1", maxlen=10)
    ((_, fields),) = client.xrange(dead)
    assert fields[b"payload"] == b"\x00bad" and fields[b"reason"] == b"no_reply_to: x"
    assert fields[b"id"].decode() == entry.id and fields[b"stream"].decode() == stream
    assert client.xpending(stream, G)["pending"] == 0


def test_stream_stats(client: redis.Redis, key_prefix: str) -> None:
    stream = keys.job_streams(key_prefix)[0]
    assert streams.stream_stats(client, stream, G)["exists"] is False
    streams.ensure_group(client, stream, G)
    for _ in range(5):
        client.xadd(stream, {"payload": b"j"})
    streams.read_new(client, [stream], G, "c1", count=2, block_ms=None)
    st = streams.stream_stats(client, stream, G)
    assert st["length"] == 5 and st["group_exists"] and st["pending"] == 2
    assert st["lag"] == 3 and st["consumers"] == 1
    assert st["consumer_details"][0]["name"] == "c1"
    assert st["consumer_details"][0]["pending"] == 2


def test_nogroup_detection() -> None:
    assert streams.is_nogroup(redis.ResponseError("NOGROUP No such key 'x'"))
    assert streams.is_nogroup(redis.ResponseError("UNBLOCKED the stream key no longer exists"))
    assert not streams.is_nogroup(redis.ResponseError("WRONGTYPE Operation"))
    assert not streams.is_nogroup(ValueError("NOGROUP"))


def test_result_of_an_entry_taken_over_is_not_written(client: redis.Redis, key_prefix: str) -> None:
    """A paused worker whose entry was reclaimed by another consumer does not answer it too."""
    stream = keys.job_streams(key_prefix)[0]
    streams.ensure_group(client, stream, G)
    reply = keys.reply_stream(stream, "c")
    client.xadd(stream, {"payload": b"j"})
    (entry,) = streams.read_new(client, [stream], G, "c1", count=10, block_ms=None)
    client.xclaim(stream, G, "c2", 0, [entry.id], justid=True)  # c2 reclaims it
    superseded: list[streams.Delivery] = []
    late = streams.Delivery(stream, entry.id, reply, b"late")
    assert (
        streams.write_results(client, G, [late], maxlen=100, consumer="c1", superseded=superseded)
        == []
    )
    assert superseded == [late] and client.xlen(reply) == 0
    assert client.xpending(stream, G)["pending"] == 1  # still c2's to answer
    on_time = streams.Delivery(stream, entry.id, reply, b"r")
    assert streams.write_results(client, G, [on_time], maxlen=100, consumer="c2") == []
    assert client.xlen(reply) == 1 and client.xpending(stream, G)["pending"] == 0
    # No longer pending at all: still answered (never lose a result to de-duplication).
    assert streams.write_results(client, G, [late], maxlen=100, consumer="c1") == []
    assert client.xlen(reply) == 2


def test_trim_acked_drops_only_what_every_group_read_and_acked(
    client: redis.Redis, key_prefix: str
) -> None:
    """A job stream does not grow forever: acked entries go, pending and unread ones stay,
    and a second group that is behind holds the floor."""
    stream = keys.job_streams(key_prefix)[0]
    streams.ensure_group(client, stream, "g1")
    ids = [client.xadd(stream, {b"payload": b"x"}) for _ in range(300)]
    got = client.xreadgroup("g1", "c", {stream: ">"}, count=200)[0][1]  # 200 read
    client.xack(stream, "g1", *[e[0] for e in got[:150]])  # 150 acked, 50 pending, 100 unread
    assert streams.trim_acked(client, stream) > 0
    left = [e[0] for e in client.xrange(stream)]
    assert set(ids[150:]) <= set(left), "a pending or unread entry was trimmed"
    assert len(left) < 300
    client.xack(stream, "g1", *[e[0] for e in got[150:]])
    streams.ensure_group(client, stream, "g2")  # a new group from 0: nothing may go
    client.xgroup_setid(stream, "g2", id="0")
    before = client.xlen(stream)
    streams.trim_acked(client, stream)
    assert client.xlen(stream) == before
    assert streams.trim_acked(client, f"{stream}-none") == 0


def test_trim_acked_stops_at_the_newest_entry_the_worker_acked(
    client: redis.Redis, key_prefix: str
) -> None:
    """A group created at ``$`` over entries (replayed later with ``XGROUP SETID ... 0``, as
    the capacity benchmark does) has nothing pending and its last delivered id at the end: the
    entries look read. A worker trims only up to the newest entry it acked itself."""
    stream = keys.job_streams(key_prefix)[0]
    ids = [client.xadd(stream, {b"payload": b"x"}) for _ in range(300)]
    streams.ensure_group(client, stream, "g1", start_id="$")
    worker = InFlight()
    assert worker.done_upto(stream) is None  # acked nothing: the daemon does not trim at all
    assert streams.trim_acked(client, stream, upto=ids[0].decode()) == 0
    assert client.xlen(stream) == 300
    client.xgroup_setid(stream, "g1", id="0")  # the replay reads them all
    got = client.xreadgroup("g1", "c", {stream: ">"}, count=300)[0][1]
    client.xack(stream, "g1", *[e[0] for e in got[:200]])
    for entry_id, _ in got[:200]:
        worker.done(stream, entry_id.decode())
    assert worker.done_upto(stream) == ids[199].decode()
    assert streams.trim_acked(client, stream, upto=worker.done_upto(stream)) > 0
    left = [e[0] for e in client.xrange(stream)]
    assert set(ids[200:]) <= set(left) and len(left) < 300
