"""The gateway names a Redis that can lose jobs as the worker does: ``scoring-worker gateway``
refuses a ``maxmemory-policy`` other than ``noeviction`` in one line (exit 2) unless
``--allow-redis-eviction``; the policy, persistence and memory are exported as the worker's
``scoring_redis_*`` metrics and shown by ``/health``, and a policy changed while serving turns
``scoring_redis_evicting`` on. Against a ``redis-server`` of this module's own."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from prometheus_client import CollectorRegistry

from tests.faults.servers import RedisServer, have_redis_server
from tests.support.daemon import ROOT, wait_until
from tests.support.gateway import GatewayThread
from worker.client.aio import AsyncScoringClient
from worker.errors import ConfigError
from worker.gateway.app import create_app
from worker.gateway.config import GatewayConfig
from worker.gateway.metrics import GatewayMetrics
from worker.observability.metrics import WorkerMetrics
from worker.observability.redis_metrics import REDIS_METRIC_NAMES
from worker.processes.local import free_port

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(not have_redis_server(), reason="redis-server not installed"),
]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as srv:
        yield srv


def test_the_gateway_exports_the_workers_redis_metrics() -> None:
    def families(metrics: object) -> dict[str, tuple[str, ...]]:
        registry: CollectorRegistry = metrics.registry  # type: ignore[attr-defined]
        return {
            m.name: tuple(sorted({k for s in m.samples for k in s.labels}))
            for m in registry.collect()
            if m.name.startswith("scoring_redis_") and m.name != "scoring_redis_reconnects"
        }

    worker, gateway = WorkerMetrics(), GatewayMetrics()
    for m in (worker, gateway):
        m.set_redis_server(
            evicting=True, allowed=True, persistent=False,
            memory_used_ratio={("10.0.0.1:6379", "maxmemory"): 0.5},
        )  # fmt: skip
    assert families(worker) == families(gateway)
    assert sorted(families(gateway)) == sorted(REDIS_METRIC_NAMES)


def test_the_gateway_command_refuses_an_evicting_policy_in_one_line(server: RedisServer) -> None:
    server.admin().config_set("maxmemory-policy", "allkeys-lru")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, "-m", "worker", "gateway", "--redis-url", server.url, "--port",
         str(free_port())],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: Redis maxmemory-policy is allkeys-lru on 127.0.0.1:")
    assert "--allow-redis-eviction" in line and "noeviction" in line


def test_the_gateway_app_refuses_too_unless_allowed(server: RedisServer) -> None:
    server.admin().config_set("maxmemory-policy", "volatile-ttl")
    core = create_app(GatewayConfig(), lambda: AsyncScoringClient(server.url, queue="gq")).core

    async def start() -> None:
        try:
            await core.start()  # the app's lifespan start-up: its failure stops uvicorn
        finally:
            await core.close()

    with pytest.raises(ConfigError, match="maxmemory-policy is volatile-ttl") as info:
        asyncio.run(start())
    assert "--allow-redis-eviction" in str(info.value) and "\n" not in str(info.value)
    with GatewayThread(server.url, "gq", allow_redis_eviction=True) as g:
        metrics = g.core.metrics.registry
        assert metrics.get_sample_value("scoring_redis_evicting") == 1
        assert metrics.get_sample_value("scoring_redis_eviction_allowed") == 1
        health = requests.get(g.url + "/health", timeout=10).json()
        assert health["redis_server"]["evicting"] is True
        assert health["redis_server"]["primaries"][0]["policy"] == "volatile-ttl"


def test_a_policy_changed_while_the_gateway_serves_turns_the_metric_on(
    server: RedisServer,
) -> None:
    admin = server.admin()
    with GatewayThread(server.url, "gq", redis_check_interval_s=0.3) as g:
        metrics = g.core.metrics.registry
        assert metrics.get_sample_value("scoring_redis_evicting") == 0
        assert metrics.get_sample_value("scoring_redis_persistent") == 0  # no AOF, no RDB
        ratio = metrics.get_sample_value(
            "scoring_redis_memory_used_ratio",
            {"primary": f"127.0.0.1:{server.port}", "limit": "system"},
        )
        assert ratio is not None and 0 < ratio < 1
        admin.config_set("maxmemory-policy", "allkeys-random")
        wait_until(
            lambda: metrics.get_sample_value("scoring_redis_evicting") == 1, 10, 0.05,
            "scoring_redis_evicting turned on",
        )  # fmt: skip
        assert requests.get(g.url + "/health", timeout=10).json()["redis_server"]["evicting"]
