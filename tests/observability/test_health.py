"""HealthState logic, the gauges bound to it, and the HTTP endpoint (/metrics, /healthz, /readyz,
/startupz) on a free port."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from worker.observability.health import HealthServer, HealthState
from worker.observability.metrics import WorkerMetrics


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
    assert details == {
        "model_ready": True, "redis_ok": True, "draining": False, "started": True,
        "redis_server": {},  # what Redis keeps: set by the worker's first read, never required
    }  # fmt: skip


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


def test_startup_only_needs_the_model() -> None:
    s = HealthState()
    assert s.startup() == (False, {"model_ready": False})
    s.model_ready = True
    assert s.startup() == (True, {"model_ready": True})
    s.draining = True  # neither draining nor Redis matter once started up
    assert s.startup()[0] is True


def test_bound_ready_gauge_follows_readiness_when_redis_flips() -> None:
    metrics = WorkerMetrics(CollectorRegistry())
    state = HealthState()
    metrics.bind_health(state)

    def ready() -> float | None:
        return metrics.registry.get_sample_value("scoring_worker_ready")

    def loaded() -> float | None:
        return metrics.registry.get_sample_value("scoring_model_loaded")

    assert (ready(), loaded()) == (0.0, 0.0)  # loading the model
    state.model_ready = True
    assert (ready(), loaded()) == (0.0, 1.0)  # loaded, not serving yet
    state.started = state.redis_ok = True
    assert ready() == 1.0
    state.redis_ok = False  # Redis went away: no code path has to set the gauge
    assert ready() == 0.0
    assert loaded() == 1.0
    state.redis_ok = True
    assert ready() == 1.0
    state.draining = True
    assert ready() == 0.0
    state.draining = False
    # After binding, set() is accepted but ignored: the gauge keeps following the state.
    metrics.ready.set(0)
    metrics.model_loaded.set(0)
    assert (ready(), loaded()) == (1.0, 1.0)
    state.redis_ok = False
    metrics.ready.set(1)
    assert ready() == 0.0


def test_bind_health_again_rebinds_to_the_new_state() -> None:
    metrics = WorkerMetrics(CollectorRegistry())
    old, new = HealthState(), _ready_state()
    metrics.bind_health(old)
    metrics.bind_health(new)
    assert metrics.registry.get_sample_value("scoring_worker_ready") == 1.0
    new.redis_ok = False
    assert metrics.registry.get_sample_value("scoring_worker_ready") == 0.0


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
def test_startupz_503_while_the_model_loads_then_200(
    served: tuple[str, HealthState, WorkerMetrics],
) -> None:
    base, state, _ = served
    code, body, ctype = _get(base + "/startupz")
    assert code == 503 and ctype == "application/json"
    assert json.loads(body) == {"ok": False, "model_ready": False}
    # /healthz answers 200 meanwhile, which is why the startup probe must not use it
    assert _get(base + "/healthz")[0] == 200
    state.model_ready = True
    code, body, _ = _get(base + "/startupz?probe=1")
    assert code == 200 and json.loads(body) == {"ok": True, "model_ready": True}
    assert _get(base + "/readyz")[0] == 503  # started up is not ready: Redis not reached yet
    state.draining = True
    assert _get(base + "/startupz")[0] == 200


@pytest.mark.timeout(20)
def test_metrics_endpoint_exports_bound_gauges(
    served: tuple[str, HealthState, WorkerMetrics],
) -> None:
    base, state, metrics = served
    metrics.bind_health(state)
    body = _get(base + "/metrics")[1]
    assert b"scoring_worker_ready 0.0" in body and b"scoring_model_loaded 0.0" in body
    state.model_ready = state.started = state.redis_ok = True
    body = _get(base + "/metrics")[1]
    assert b"scoring_worker_ready 1.0" in body and b"scoring_model_loaded 1.0" in body
    state.redis_ok = False
    assert b"scoring_worker_ready 0.0" in _get(base + "/metrics")[1]


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
