"""The client and queue admin on a real 3-primary Redis Cluster: partitions on different slots,
one reply stream, queue info and dead-letter replay per partition."""

from __future__ import annotations

import threading
import uuid
from array import array

import pytest
import redis

from tests.support.cluster import ClusterInfo, redis_cluster  # noqa: F401 - fixture
from worker import keys, protocol
from worker.client import ScoringClient
from worker.streams import admin as queue_admin

pytestmark = [pytest.mark.redis, pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(120)]


def _respond(rc: redis.RedisCluster, streams: list[str], stop: threading.Event) -> None:
    """A cluster-aware worker double: one XREADGROUP per stream (each stream is its own slot)."""
    while not stop.is_set():
        for s in streams:
            for _, entries in rc.xreadgroup("scoring", "d", {s: ">"}, count=16, block=10) or []:
                for entry_id, fields in entries:
                    job = protocol.decode_job(fields[b"payload"])
                    seqs = [
                        protocol.SeqResult(logps=array("f", [-1.0] * sq.num_scored))
                        for sq in job.seqs
                    ]
                    res = protocol.Result(id=job.id, ok=True, seqs=seqs, meta=job.meta)
                    rc.xadd(job.reply_to, {"payload": protocol.encode_result(res)})
                    rc.xack(s, "scoring", entry_id)


def test_client_and_admin_on_cluster(redis_cluster: ClusterInfo) -> None:  # noqa: F811
    queue = f"c{uuid.uuid4().hex[:8]}"
    streams = keys.job_streams(queue, 3)
    rc = redis_cluster.client()
    assert len({redis_cluster.node_of_slot(rc.keyslot(s)) for s in streams}) >= 2
    for s in streams:
        rc.xgroup_create(s, "scoring", id="0", mkstream=True)
    stop = threading.Event()
    responder = threading.Thread(target=_respond, args=(rc, streams, stop), daemon=True)
    responder.start()
    try:
        with ScoringClient(redis_cluster.url, queue=queue, partitions=3) as client:
            jobs = [[([1, 2, 3, i + 4], 1)] for i in range(12)]
            results = list(client.score_many(jobs, max_in_flight=4, ordered=False, timeout=30))
            assert len(results) == 12
            assert all(list(r.seqs[0].logps) == [-1.0] * 3 for r in results)
        assert not rc.exists(client.reply_stream)
    finally:
        stop.set()
        responder.join(5)

    # a dead letter on partition 1, replayed back to its job stream on the same slot
    payload = protocol.encode_job("dl-1", "reference", "x", [{"tokens": [1, 2], "prompt_len": 1}])
    rc.xadd(keys.dead_letter_stream(streams[1]), {"payload": payload, "reason": "test"})
    info = queue_admin.queue_info(rc, queue, 3)
    assert info["total"]["dead_letters"] == 1 and info["total"]["lag"] == 0
    assert [p["length"] for p in info["streams"]] == [int(rc.xlen(s)) for s in streams]
    (entry,) = queue_admin.dlq_replay(rc, queue, 3, ids=["dl-1"])
    assert entry.job_id == "dl-1" and entry.job_stream == streams[1]
    assert queue_admin.queue_info(rc, queue, 3)["streams"][1]["lag"] == 1
    for key in [*streams, *(keys.dead_letter_stream(s) for s in streams)]:
        rc.delete(key)
