"""What Redis keeps (``worker.connections``): the eviction policy, persistence and memory of each
primary, read with ``CONFIG GET`` or, where an ACL refuses it, ``INFO``; the start-up check that
refuses a policy that evicts in one line; the watch that notices a policy changed at run time.
Against a real ``redis-server`` of this module's own (its configuration is changed freely)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import redis

from tests.faults.servers import RedisServer, have_redis_server
from tests.support.cluster import ClusterInfo, redis_cluster  # noqa: F401 - fixture
from worker.config import RedisSettings
from worker.connections import (
    ServerWatch,
    check_server,
    connect,
    eviction_problem,
    persistence_problem,
    server_states,
)
from worker.errors import ConfigError

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(not have_redis_server(), reason="redis-server not installed"),
]
EVICTING = ["allkeys-lru", "allkeys-random", "volatile-lru", "volatile-ttl"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A server with AOF on (persistent) and ``noeviction``; each test restores what it changes."""
    with RedisServer(tmp_path_factory.mktemp("evict"), args=["--appendonly", "yes"]) as srv:
        yield srv


@pytest.fixture
def admin(server: RedisServer) -> Iterator[redis.Redis]:
    client = server.admin()
    yield client
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("appendonly", "yes")
    client.config_set("maxmemory", 0)
    client.close()


def _client(url: str) -> redis.Redis:
    return connect(RedisSettings(url=url))  # type: ignore[return-value]


@pytest.mark.parametrize("policy", EVICTING)
def test_a_policy_that_evicts_is_refused_in_one_line_within_a_second(
    server: RedisServer, admin: redis.Redis, policy: str
) -> None:
    admin.config_set("maxmemory-policy", policy)
    client = _client(server.url)
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        check_server(client, allow_eviction=False)
    assert time.monotonic() - start < 1.0
    message = str(info.value)
    assert "\n" not in message and info.value.hint is None  # one line
    assert f"maxmemory-policy is {policy}" in message
    assert "maxmemory-policy noeviction" in message and "--allow-redis-eviction" in message
    lost = "reply streams" if policy.startswith("volatile") else "job streams"
    assert lost in message


def test_allowed_eviction_is_logged_and_read_back(
    server: RedisServer, admin: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    admin.config_set("maxmemory-policy", "allkeys-lru")
    with caplog.at_level(logging.WARNING, logger="worker.connections"):
        (state,) = check_server(_client(server.url), allow_eviction=True)
    assert state.evicts and state.policy == "allkeys-lru" and state.via == "config"
    assert any("--allow-redis-eviction" in r.getMessage() for r in caplog.records)


def test_noeviction_with_aof_says_nothing(
    server: RedisServer, admin: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="worker.connections"):
        (state,) = check_server(_client(server.url), allow_eviction=False)
    assert not caplog.records
    assert state.policy == "noeviction" and state.aof is True and state.persistent is True
    assert state.memory_limit == "system" and 0 < (state.memory_used_ratio or 0) < 1


def test_no_persistence_is_a_warning_not_a_refusal(
    server: RedisServer, admin: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    admin.config_set("appendonly", "no")  # and the harness's --save "": no RDB either
    with caplog.at_level(logging.WARNING, logger="worker.connections"):
        states = check_server(_client(server.url), allow_eviction=False)
    assert states[0].persistent is False
    warning = persistence_problem(states)
    assert warning and "restart" in warning
    assert [r.getMessage() for r in caplog.records] == [warning]


def test_an_acl_user_without_config_falls_back_to_info(
    server: RedisServer, admin: redis.Redis
) -> None:
    admin.acl_setuser(
        "noconfig", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-config"]
    )
    admin.config_set("maxmemory-policy", "volatile-lru")
    admin.config_set("maxmemory", 64 << 20)
    client = _client(server.user_url("noconfig", "pw"))
    with pytest.raises(redis.ResponseError):
        client.config_get("maxmemory-policy")  # the ACL refuses CONFIG
    (state,) = server_states(client)
    assert state.via == "info" and state.policy == "volatile-lru" and state.evicts
    assert state.aof is True and state.rdb is None  # INFO cannot tell RDB
    assert state.maxmemory_bytes == 64 << 20 and state.memory_limit == "maxmemory"
    assert state.memory_used_ratio is not None and 0 < state.memory_used_ratio < 1
    with pytest.raises(ConfigError, match="volatile-lru"):
        check_server(client, allow_eviction=False)


def test_a_user_without_info_cannot_say_and_is_not_refused(
    server: RedisServer, admin: redis.Redis
) -> None:
    admin.acl_setuser(
        "blind", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-config", "-info"]
    )
    admin.config_set("maxmemory-policy", "allkeys-lru")
    admin.acl_log_reset()
    client = _client(server.user_url("blind", "pw"))
    (state,) = check_server(client, allow_eviction=False)
    assert state.policy is None and not state.evicts and state.via == "none"
    watch = ServerWatch(interval_s=0.01, states=[state])
    assert watch.read(client) == [state]  # asked no more: one denial, not one a minute
    denied = [e for e in admin.acl_log() if e["username"] == "blind"]
    assert [(e["object"], e["count"]) for e in denied] == [("info", 1)]


def test_the_watch_notices_a_policy_changed_while_serving(
    server: RedisServer, admin: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    client = _client(server.url)
    watch = ServerWatch(interval_s=0.2, states=check_server(client, allow_eviction=False))
    assert watch.poll(client) is None  # not due yet
    assert not watch.evicting
    admin.config_set("maxmemory-policy", "allkeys-random")
    time.sleep(0.25)
    with caplog.at_level(logging.ERROR, logger="worker.connections"):
        states = watch.poll(client)
    assert states is not None and watch.evicting
    (record,) = caplog.records
    assert "changed from noeviction to allkeys-random" in record.getMessage()
    assert eviction_problem(states) is not None


def test_every_primary_of_a_cluster_is_read(redis_cluster: ClusterInfo) -> None:  # noqa: F811
    client = connect(RedisSettings(url=redis_cluster.url))
    primaries = client.get_primaries()  # type: ignore[union-attr]
    states = server_states(client)
    assert sorted(s.node for s in states) == sorted(f"{n.host}:{n.port}" for n in primaries)
    assert {s.policy for s in states} == {"noeviction"}
    node = primaries[-1]
    admin = redis.Redis(host=node.host, port=node.port)
    admin.config_set("maxmemory-policy", "volatile-ttl")  # one primary of the shared cluster
    try:
        with pytest.raises(ConfigError, match=f"volatile-ttl on {node.host}:{node.port}"):
            check_server(client, allow_eviction=False)
    finally:
        admin.config_set("maxmemory-policy", "noeviction")


def test_the_watch_asks_config_once_then_info_only(server: RedisServer, admin: redis.Redis) -> None:
    admin.acl_setuser(
        "once", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-config"]
    )
    admin.acl_log_reset()
    client = _client(server.user_url("once", "pw"))
    watch = ServerWatch(interval_s=0.01)
    for _ in range(3):
        (state,) = watch.read(client)
        assert state.via == "info" and state.policy == "noeviction"
    denied = [e for e in admin.acl_log() if e["username"] == "once"]
    assert [(e["object"], e["count"]) for e in denied] == [("config|get", 1)]
