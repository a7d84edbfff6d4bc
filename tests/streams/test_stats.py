"""Stream statistics have one source: the worker's gauges (``streams.stream_stats``) and
``scoring-worker info`` (``streams.admin.stream_info`` / ``queue_info``) report the same length,
lag, pending and consumers, including with no stream and with no consumer group (where all of
the stream is lag), against the machine's real Redis."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from worker import keys, streams
from worker.streams.admin import queue_info, stream_info

pytestmark = pytest.mark.redis
G = keys.DEFAULT_GROUP


@pytest.fixture
def client(redis_url: str, key_prefix: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    for key in c.scan_iter(match=f"*{key_prefix}*", count=1000):
        c.delete(key)
    c.close()


def _both(client: redis.Redis, stream: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The daemon's view and the info command's view of one stream, checked to agree."""
    gauges = streams.stream_stats(client, stream, G)
    info = stream_info(client, stream, G)
    for field in ("length", "exists", "group_exists", "lag", "pending", "last_delivered_id"):
        assert gauges[field] == info[field], field
    assert gauges["consumers"] == len(info["consumers"])
    assert [(c["name"], c["pending"]) for c in gauges["consumer_details"]] == [
        (c["name"], c["pending"]) for c in info["consumers"]
    ]
    return gauges, info


def test_missing_stream_has_no_lag(client: redis.Redis, key_prefix: str) -> None:
    stream = keys.job_streams(key_prefix)[0]
    gauges, info = _both(client, stream)
    assert (gauges["exists"], gauges["length"], gauges["lag"], gauges["pending"]) == (
        False,
        0,
        0,
        0,
    )
    assert info["oldest_pending_age_s"] is None and info["consumers"] == []


def test_missing_group_means_the_whole_stream_is_lag(client: redis.Redis, key_prefix: str) -> None:
    """No group yet (no worker has started): workers create it at id 0 and will read every
    entry, so both views report the whole stream as lag."""
    stream = keys.job_streams(key_prefix)[0]
    for _ in range(4):
        client.xadd(stream, {"payload": b"j"})
    client.xgroup_create(stream, "another-group", id="$")  # a group, but not ours
    gauges, info = _both(client, stream)
    assert gauges["exists"] and not gauges["group_exists"]
    assert gauges["lag"] == info["lag"] == 4 and gauges["pending"] == 0
    # the group the workers create then delivers exactly that many entries
    assert streams.ensure_group(client, stream, G)
    assert streams.stream_stats(client, stream, G)["lag"] == 4
    got = streams.read_new(client, [stream], G, "c1", count=100, block_ms=None)
    assert len(got) == 4


def test_group_with_reads_and_pending(client: redis.Redis, key_prefix: str) -> None:
    stream = keys.job_streams(key_prefix)[0]
    streams.ensure_group(client, stream, G)
    for _ in range(5):
        client.xadd(stream, {"payload": b"j"})
    streams.read_new(client, [stream], G, "c1", count=2, block_ms=None)
    streams.read_new(client, [stream], G, "c2", count=1, block_ms=None)
    gauges, info = _both(client, stream)
    assert (gauges["length"], gauges["lag"], gauges["pending"], gauges["consumers"]) == (5, 2, 3, 2)
    assert info["oldest_pending_age_s"] is not None and info["oldest_pending_age_s"] >= 0
    assert all(c["idle_ms"] >= 0 for c in gauges["consumer_details"])


def test_queue_totals_add_up_partitions_without_a_group(
    client: redis.Redis, key_prefix: str
) -> None:
    """A queue whose partitions are in every state: read, never read (no group), absent."""
    s0, s1, s2 = keys.job_streams(key_prefix, 3)
    streams.ensure_group(client, s0, G)
    for _ in range(3):
        client.xadd(s0, {"payload": b"j"})
    streams.read_new(client, [s0], G, "c1", count=1, block_ms=None)
    for _ in range(2):
        client.xadd(s1, {"payload": b"j"})  # no group on s1; s2 does not exist
    info = queue_info(client, key_prefix, 3, G)
    lags = [p["lag"] for p in info["streams"]]
    assert lags == [streams.stream_stats(client, s, G)["lag"] for s in (s0, s1, s2)]
    assert lags == [2, 2, 0] and info["total"]["lag"] == 4
    assert info["total"]["pending"] == 1 and info["total"]["length"] == 5
