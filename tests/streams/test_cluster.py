"""worker.streams on a real 3-primary Redis Cluster: partitions in different slots are read
without CROSSSLOT, same-slot results are written atomically, cross-slot ones result-then-ack."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.support.cluster import ClusterInfo, redis_cluster  # noqa: F401 - fixture
from worker import keys, streams
from worker.keys import same_slot

pytestmark = [pytest.mark.redis, pytest.mark.cluster]
G = "scoring"


@pytest.mark.timeout(60)
def test_streams_commands_on_cluster(redis_cluster: ClusterInfo) -> None:  # noqa: F811
    client = redis_cluster.client()
    queue = f"cl{uuid.uuid4().hex[:8]}"
    parts = keys.job_streams(queue, 4)
    assert len({redis_cluster.node_of_slot(client.keyslot(p)) for p in parts}) > 1
    for p in parts:
        assert streams.ensure_group(client, p, G)
        client.xadd(p, {"payload": p.encode()})
    got = streams.read_new(client, parts, G, "c1", count=10, block_ms=100, rotation=3)
    assert sorted(e.stream for e in got) == sorted(parts)
    assert streams.read_new(client, parts, G, "c1", count=10, block_ms=50) == []

    same = keys.reply_stream(parts[0], "me")  # same tag as parts[0] only
    assert same_slot(same, parts[0]) and not same_slot(same, parts[1])
    by_stream = {e.stream: e for e in got}
    deliveries = [streams.Delivery(p, by_stream[p].id, same, p.encode()) for p in parts]
    assert streams.write_results(client, G, deliveries, maxlen=100) == []
    assert sorted(f[b"payload"] for _, f in client.xrange(same)) == sorted(
        p.encode() for p in parts
    )
    assert all(client.xpending(p, G)["pending"] == 0 for p in parts)

    client.xadd(parts[1], {"payload": b"x"})
    entry = streams.read_new(client, [parts[1]], G, "c1", count=1, block_ms=None)[0]
    assert streams.renew_leases(client, parts[1], G, "c1", [entry.id]) == [entry.id]
    time.sleep(0.12)
    claimed, _ = streams.reclaim_idle(
        client, parts[1], G, "c2", min_idle_ms=100, count=5, use_autoclaim=True
    )
    assert [(e.id, e.deliveries) for e in claimed] == [(entry.id, 2)]
    dead = keys.dead_letter_stream(parts[1])
    streams.dead_letter(client, G, claimed[0], dead, reason="test: x", consumer="c2", maxlen=10)
    other_dead = keys.dead_letter_stream(parts[2])  # cross-slot dead-letter stream
    client.xadd(parts[1], {"payload": b"y"})
    entry2 = streams.read_new(client, [parts[1]], G, "c1", count=1, block_ms=None)[0]
    streams.dead_letter(client, G, entry2, other_dead, reason="test: y", consumer="c1", maxlen=10)
    assert client.xlen(dead) == 1 and client.xlen(other_dead) == 1
    assert client.xpending(parts[1], G)["pending"] == 0
    st = streams.stream_stats(client, parts[1], G)
    assert st["group_exists"] and st["pending"] == 0 and st["length"] == 3
    for key in [*parts, same, dead, other_dead]:
        client.delete(key)


@pytest.mark.timeout(60)
def test_cross_slot_reply_write_failure_keeps_the_entry_pending(
    redis_cluster: ClusterInfo,  # noqa: F811
) -> None:
    """The non-atomic path (reply stream in another slot): a result XADD refused with WRONGTYPE
    is reported and its entry stays pending (not acked), while a good cross-slot result in the
    same batch is written and acked; once the reply key is usable the retry succeeds."""
    client = redis_cluster.client()
    queue = f"cx{uuid.uuid4().hex[:8]}"
    job, other = keys.job_streams(queue, 2)
    bad_reply = keys.reply_stream(other, "bad")  # other's hash tag: not job's slot
    good_reply = keys.reply_stream(other, "good")
    assert not same_slot(bad_reply, job) and not same_slot(good_reply, job)
    try:
        assert streams.ensure_group(client, job, G)
        client.xadd(job, {"payload": b"a"})
        client.xadd(job, {"payload": b"b"})
        a, b = streams.read_new(client, [job], G, "c1", count=2, block_ms=None)
        client.set(bad_reply, "not a stream")
        bad = streams.Delivery(job, a.id, bad_reply, b"result-a")
        good = streams.Delivery(job, b.id, good_reply, b"result-b")
        failures = streams.write_results(client, G, [bad, good], maxlen=100, consumer="c1")
        assert [d for d, _ in failures] == [bad]
        assert "WRONGTYPE" in failures[0][1]
        rows = client.xpending_range(job, G, "-", "+", 10)
        assert [r["message_id"].decode() for r in rows] == [a.id]  # b acked, a still held
        assert [f[b"payload"] for _, f in client.xrange(good_reply)] == [b"result-b"]

        client.delete(bad_reply)  # the key is fixed: the retry writes and acks
        assert streams.write_results(client, G, [bad], maxlen=100, consumer="c1") == []
        assert client.xpending(job, G)["pending"] == 0
        assert [f[b"payload"] for _, f in client.xrange(bad_reply)] == [b"result-a"]
    finally:
        for key in (job, other, bad_reply, good_reply):
            client.delete(key)


@pytest.mark.timeout(60)
def test_hand_back_on_cluster(redis_cluster: ClusterInfo) -> None:  # noqa: F811
    """The hand-back script (stream + its hand-back hash, one slot) and the counters the other
    workers poll (one pipeline over partitions on several nodes)."""
    client = redis_cluster.client()
    parts = keys.job_streams(f"hb{uuid.uuid4().hex[:8]}", 4)
    for p in parts:
        streams.ensure_group(client, p, G)
        client.xadd(p, {"payload": b"x"})
    got = streams.read_new(client, parts, G, "leaving", count=10, block_ms=100)
    for e in got:
        assert streams.hand_back(client, e.stream, G, "leaving", [e.id]) == [e.id]
    assert streams.handback_marks(client, parts) == {p: {"leaving": 1} for p in parts}
    for p in parts:
        claimed, _ = streams.reclaim_idle(
            client, p, G, "taker", min_idle_ms=30000, count=10, use_autoclaim=True
        )
        assert [c.deliveries for c in claimed] == [1]
        assert streams.forget_givers(client, p, G, ["leaving"]) == ["leaving"]
