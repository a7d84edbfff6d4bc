"""``dlq list`` per partition and in total on a real 3-primary Redis Cluster (the partitions'
dead-letter streams live on different primaries; no CROSSSLOT)."""

from __future__ import annotations

import json
import uuid

import pytest

from tests.support.cluster import ClusterInfo, redis_cluster
from tests.support.daemon import add_dead_letter
from worker import keys
from worker.cli import main

pytestmark = [pytest.mark.redis, pytest.mark.cluster]
__all__ = ["redis_cluster"]  # the session fixture, imported so pytest finds it here


@pytest.mark.timeout(60)
def test_dlq_list_per_partition_on_cluster(
    redis_cluster: ClusterInfo, capsys: pytest.CaptureFixture[str]
) -> None:
    client = redis_cluster.client()
    queue = f"dq{uuid.uuid4().hex[:8]}"
    streams = keys.job_streams(queue, 3)
    dead = [keys.dead_letter_stream(s) for s in streams]
    assert len({redis_cluster.node_of_slot(client.keyslot(d)) for d in dead}) > 1
    common = ["--redis-url", redis_cluster.url, "--queue", queue, "--partitions", "3"]
    try:
        add_dead_letter(client, streams[0], "a")
        add_dead_letter(client, streams[2], "b")
        add_dead_letter(client, streams[2], "c")
        assert main(["dlq", "list", *common, "--json"]) == 0
        *rows, last = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert [(e["partition"], e["job_stream"], e["job_id"]) for e in rows] == [
            (0, streams[0], "a"),
            (2, streams[2], "b"),
            (2, streams[2], "c"),
        ]
        summary = last["summary"]
        assert summary["total"] == 3
        assert [p["dead_letters"] for p in summary["by_partition"]] == [1, 0, 2]
        assert main(["dlq", "list", *common, "--partition", "2", "--json"]) == 0
        *rows, last = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert [e["job_id"] for e in rows] == ["b", "c"] and last["summary"]["total"] == 2
        assert main(["dlq", "list", *common]) == 0
        captured = capsys.readouterr()
        assert streams[2] in captured.out and "CROSSSLOT" not in captured.err
    finally:
        for key in [*streams, *dead]:
            client.delete(key)
