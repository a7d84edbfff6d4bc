"""HealthState logic and the HTTP endpoint (/metrics, /healthz, /readyz) on a free port."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from worker.health import HealthServer, HealthState
from worker.metrics import WorkerMetrics


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _ready_state(**kw: object) -> HealthState:
    s = HealthState(**kw)  # type: ignore[arg-type]
    s.model_ready = s.redis_ok = s.started = True
    return s


def test_not_ready_until_started_model_loaded_and_redis_ok() -> None:
    s = HealthState()
    assert s.readiness()[0] is False
    s.started = True
    s.model_ready = True
    assert s.readiness()[0] is False  # redis not yet reachable
    s.redis_ok = True
    ok, details = s.readiness()
    assert ok is True
    assert details == {"model_ready": True, "redis_ok": True, "draining": False, "started": True}


@pytest.mark.parametrize("flag", ["model_ready", "redis_ok", "started"])
def test_each_readiness_condition_is_required(flag: str) -> None:
    s = _ready_state()
    setattr(s, flag, False)
    assert s.readiness()[0] is False


def test_draining_makes_not_ready() -> None:
    s = _ready_state()
    s.draining = True
    ok, details = s.readiness()
    assert not ok and details["draining"] is True


def test_liveness_fails_when_a_heartbeat_stalls_and_recovers_on_beat() -> None:
    clock = FakeClock()
    s = HealthState(stall_after_s=10.0, clock=clock)
    assert s.liveness()[0] is True
    clock.t += 50
    assert s.liveness()[0] is True  # loading the model (not started) never counts as a stall
    s.started = True
    s.beat("loop")
    s.beat("lease")
    clock.t += 5
    s.beat("loop")
    clock.t += 6  # lease is 11 s old, loop 6 s
    ok, details = s.liveness()
    assert not ok
    assert details["stalled"] == ["lease"]
    assert details["heartbeat_age_s"]["loop"] == pytest.approx(6.0)
    s.busy_beat("lease")
    assert s.liveness()[0] is True


@pytest.fixture
def served() -> Iterator[tuple[str, HealthState, WorkerMetrics]]:
    metrics = WorkerMetrics(CollectorRegistry())
    state = HealthState(stall_after_s=60.0)
    server = HealthServer(metrics.registry, state, host="127.0.0.1", port=0).start()
    try:
        yield f"http://127.0.0.1:{server.port}", state, metrics
    finally:
        server.stop()


def _get(url: str) -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("Content-Type", "")


@pytest.mark.timeout(20)
def test_http_endpoints_reflect_state(served: tuple[str, HealthState, WorkerMetrics]) -> None:
    base, state, _ = served
    code, body, ctype = _get(base + "/readyz")
    assert code == 503 and ctype == "application/json"
    assert json.loads(body)["ok"] is False
    state.started = state.model_ready = state.redis_ok = True
    code, body, _ = _get(base + "/readyz")
    assert code == 200 and json.loads(body)["ok"] is True
    state.redis_ok = False
    assert _get(base + "/readyz")[0] == 503
    code, body, _ = _get(base + "/healthz")
    assert code == 200 and json.loads(body)["stalled"] == []
    assert _get(base + "/livez")[0] == 200
    assert _get(base + "/nope")[0] == 404


@pytest.mark.timeout(20)
def test_healthz_503_when_stalled() -> None:
    clock = FakeClock()
    state = HealthState(stall_after_s=1.0, clock=clock)
    state.started = True
    server = HealthServer(CollectorRegistry(), state, port=0).start()
    try:
        clock.t += 5
        code, body, _ = _get(f"http://127.0.0.1:{server.port}/healthz")
        assert code == 503
        assert sorted(json.loads(body)["stalled"]) == ["lease", "loop"]
    finally:
        server.stop()


@pytest.mark.timeout(20)
def test_metrics_endpoint_serves_the_registry(
    served: tuple[str, HealthState, WorkerMetrics],
) -> None:
    base, _, metrics = served
    metrics.record_job("too_long")
    code, body, ctype = _get(base + "/metrics?x=1")
    assert code == 200 and ctype.startswith("text/plain")
    assert b'scoring_jobs_total{outcome="too_long"} 1.0' in body
