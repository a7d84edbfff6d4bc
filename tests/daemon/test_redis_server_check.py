"""A worker names a Redis that can lose jobs before it does: ``serve`` refuses a
``maxmemory-policy`` other than ``noeviction`` in one line (exit 2) unless
``--allow-redis-eviction``, which serves, logs it and shows it in the metrics, ``/readyz`` and
``scoring-worker info``; a policy changed while serving turns ``scoring_redis_evicting`` on within
``--redis-check-interval-s``. Against real ``redis-server`` processes of this module's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.faults.servers import RedisServer, have_redis_server
from tests.support.daemon import ROOT, WorkerProc, metric, thread_worker, wait_until
from worker.scorer.noop import NoopScorer

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(not have_redis_server(), reason="redis-server not installed"),
]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as srv:
        yield srv


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "worker", *args], capture_output=True, text=True, cwd=ROOT,
        env=env, timeout=timeout, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    "policy", ["allkeys-lru", "allkeys-random", "volatile-lru", "volatile-ttl"]
)
def test_serve_refuses_an_evicting_policy_in_one_line(server: RedisServer, policy: str) -> None:
    server.admin().config_set("maxmemory-policy", policy)
    start = time.monotonic()
    res = _cli("serve", "--redis-url", server.url, "--queue", "ev", "--scorer", "noop",
               "--metrics-port", "-1")  # fmt: skip
    took = time.monotonic() - start
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"error: Redis maxmemory-policy is {policy} on 127.0.0.1:")
    assert "--allow-redis-eviction" in lines[0] and "noeviction" in lines[0]
    # the check itself takes milliseconds (tests/kernel); this bounds the whole process
    assert took < 5, took
    assert not server.admin().keys("scoring:*")  # refused before anything was created


def test_allowed_eviction_serves_and_says_so_everywhere(
    server: RedisServer, tmp_path: Path
) -> None:
    server.admin().config_set("maxmemory-policy", "allkeys-lru")
    worker = WorkerProc(
        ["--redis-url", server.url, "--queue", "ev", "--scorer", "noop", "--consumer", "w-ev",
         "--metrics-port", "0", "--allow-redis-eviction"],
        tmp_path / "worker.log",
    )  # fmt: skip
    try:
        worker.wait_ready(60)
        url = worker.metrics_url
        assert metric(url, "scoring_redis_evicting") == 1
        assert metric(url, "scoring_redis_eviction_allowed") == 1
        assert metric(url, "scoring_redis_persistent") == 0  # the harness's server keeps nothing
        assert "--allow-redis-eviction" in worker.log()
        ready = json.loads(urllib.request.urlopen(url.replace("/metrics", "/readyz")).read())
        assert ready["ok"] and ready["redis_server"]["evicting"] is True
        assert ready["redis_server"]["eviction_allowed"] is True

        def shown() -> dict | None:
            res = _cli("info", "--redis-url", server.url, "--queue", "ev", "--json")
            doc = json.loads(res.stdout)
            return doc if doc["redis"]["eviction_allowed_by"] == ["w-ev"] else None

        doc = wait_until(shown, 30, 0.5, "info lists the worker that allows eviction")
        assert doc["redis"]["evicting"] and "allkeys-lru" in doc["redis"]["eviction_warning"]
        assert doc["redis"]["primaries"][0]["policy"] == "allkeys-lru"
        table = _cli("info", "--redis-url", server.url, "--queue", "ev").stdout
        assert "maxmemory-policy allkeys-lru" in table and "serving anyway: w-ev" in table
        assert "--allow-redis-eviction" in table  # on the worker's line
    finally:
        worker.stop()


def test_noeviction_says_nothing_and_the_metric_is_zero(server: RedisServer) -> None:
    with thread_worker(server.url, "quiet", NoopScorer()) as (worker, registry):
        wait_until(lambda: worker.health.started, 30, 0.05, "worker started")
        assert registry.get_sample_value("scoring_redis_evicting") == 0
        assert registry.get_sample_value("scoring_redis_eviction_allowed") == 0
        assert worker.health.redis_server["evicting"] is False


def test_a_policy_changed_while_serving_turns_the_metric_on(server: RedisServer) -> None:
    admin: redis.Redis = server.admin()
    admin.config_set("maxmemory", 256 << 20)
    with thread_worker(server.url, "watched", NoopScorer(), redis_check_interval_s=0.5) as (
        worker,
        registry,
    ):
        wait_until(lambda: worker.health.started, 30, 0.05, "worker started")
        assert registry.get_sample_value("scoring_redis_evicting") == 0
        primary = f"127.0.0.1:{server.port}"
        ratio = registry.get_sample_value(
            "scoring_redis_memory_used_ratio", {"primary": primary, "limit": "maxmemory"}
        )
        assert ratio is not None and 0 < ratio < 0.1
        admin.config_set("maxmemory-policy", "volatile-lru")
        start = time.monotonic()
        wait_until(
            lambda: registry.get_sample_value("scoring_redis_evicting") == 1, 10, 0.05,
            "scoring_redis_evicting turned on",
        )  # fmt: skip
        assert time.monotonic() - start < 5  # within a few check intervals
        assert worker.health.started  # logged and shown, never a stop while serving
