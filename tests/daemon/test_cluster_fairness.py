"""Partition fairness on a real 3-primary Redis Cluster (the standalone case is in
tests/processes/test_supervisor_serve.py): one in-process noop worker serves 4 partitions whose
slots live on different primaries, with very uneven work; no partition waits while another is
being served."""

from __future__ import annotations

import itertools
import uuid

import pytest
from prometheus_client import CollectorRegistry

from tests.support.cluster import ClusterInfo, redis_cluster
from worker import keys
from worker.config import RedisSettings
from worker.daemon.config import WorkerConfig
from worker.protocol import decode_result, encode_job

pytestmark = [pytest.mark.redis, pytest.mark.cluster]
__all__ = ["redis_cluster"]  # the session fixture, imported so pytest finds it here

PARTITIONS = 4
JOBS = (40, 12, 4, 1)  # per partition: one flooded, one idle-ish
READ_COUNT = 4  # entries read per partition per round
SEQ = {"tokens": [1, 2, 3, 4], "prompt_len": 1}


@pytest.mark.timeout(60)
def test_uneven_partitions_on_cluster_are_served_fairly(redis_cluster: ClusterInfo) -> None:
    from worker.daemon import Worker
    from worker.observability.metrics import WorkerMetrics
    from worker.scorer.noop import NoopScorer

    client = redis_cluster.client()
    queue = f"fair{uuid.uuid4().hex[:8]}"
    streams = keys.job_streams(queue, PARTITIONS)
    assert len({redis_cluster.node_of_slot(client.keyslot(s)) for s in streams}) > 1
    reply = keys.reply_stream(streams[0], "fair")  # one reply stream: one global answer order
    try:
        for p, (stream, n) in enumerate(zip(streams, JOBS, strict=True)):
            client.xgroup_create(stream, keys.DEFAULT_GROUP, id="0", mkstream=True)
            pipe = client.pipeline(transaction=False)
            for i in range(n):
                pipe.xadd(stream, {"payload": encode_job(f"p{p}-{i}", "reference", reply, [SEQ])})
            pipe.execute()
        config = WorkerConfig(
            streams=tuple(streams),
            consumer="fair",
            metrics_port=None,
            burst=True,
            read_count=READ_COUNT,
            max_batch_tokens=4 * len(SEQ["tokens"]),
            block_ms=50,
            claim_idle_ms=30000,
        )
        worker = Worker(
            config,
            RedisSettings(url=redis_cluster.url),
            NoopScorer(),
            metrics=WorkerMetrics(CollectorRegistry()),
        )
        assert worker.run() == 0
        order = [decode_result(f[b"payload"]).id for _, f in client.xrange(reply)]
        assert sorted(order) == sorted(f"p{p}-{i}" for p, n in enumerate(JOBS) for i in range(n))
        part = [int(job_id[1]) for job_id in order]
        # Every partition gets served in the first round of reads (not after the flood) ...
        bound = PARTITIONS * READ_COUNT
        for p in range(PARTITIONS):
            assert part.index(p) < bound, (p, part)
        # ... and, while it still has work, never waits more than two rounds for its next result.
        for p in range(PARTITIONS):
            at = [i for i, q in enumerate(part) if q == p]
            gaps = [b - a - 1 for a, b in itertools.pairwise(at)]
            assert max(gaps, default=0) <= 2 * bound, (p, part)
        # The small partitions are done while the flooded one still has most of its work.
        last_small = max(i for i, q in enumerate(part) if q != 0)
        assert part[:last_small].count(0) <= JOBS[0] // 2, part
        assert all(int(client.xpending(s, keys.DEFAULT_GROUP)["pending"]) == 0 for s in streams)
    finally:
        for key in [*streams, reply]:
            client.delete(key)
