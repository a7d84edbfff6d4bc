"""The queue rule at the gateway, against a real Redis and real no-op workers
(``serve --scorer noop``): a gateway started before any worker answers a request in flight once a
worker starts 5 s later (scale from zero: a queue with a consumer group, or any queue with
``allow_unknown_queue``); a queue nobody ever served is refused at once (503 ``unknown_queue``,
naming the queues there are), nothing written to Redis, a warning at start, ``/health`` says so.
Keys: HTTP Basic with the key as password (OpenRLHF's URL), 401s counted and logged."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import requests

from tests.support.daemon import WorkerProc
from tests.support.gateway import GatewayThread
from worker import keys
from worker.gateway import middleware

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120), pytest.mark.usefixtures("cleanup_keys")]

KEY = "k3y-for-the-url"


def _noop_text(text: str) -> float:
    return (sum(text.encode()) % 1000) / 1000


def _worker(redis_url: str, queue: str, log: Path) -> WorkerProc:
    args = ["--redis-url", redis_url, "--queue", queue, "--scorer", "noop", "--consumer", "w1",
            "--metrics-port", "0"]  # fmt: skip
    return WorkerProc(args, log)


@pytest.mark.parametrize("served_before", [True, False], ids=["group", "allow-unknown"])
def test_a_request_in_flight_is_answered_by_a_worker_started_5_s_later(
    redis_url: str, key_prefix: str, tmp_path: Path, served_before: bool
) -> None:
    r = redis.Redis.from_url(redis_url)
    if served_before:  # a fleet scaled to zero: its group stays, no worker is live
        r.xgroup_create(keys.job_streams(key_prefix)[0], keys.DEFAULT_GROUP, id="$", mkstream=True)
    config: dict[str, Any] = {"timeout_s": 90.0}
    if not served_before:
        config["allow_unknown_queue"] = True
    got: dict[str, Any] = {}
    with GatewayThread(redis_url, key_prefix, **config) as g:
        health = requests.get(g.url + "/health", timeout=10).json()
        assert health["worker"] is False and health["queue_state"]["live_workers"] == 0
        assert health["queue_state"]["known"] is served_before

        def ask() -> None:
            started = time.monotonic()
            got["response"] = requests.post(
                g.url + "/get_reward", json={"query": ["ab"]}, timeout=100
            )
            got["waited_s"] = time.monotonic() - started

        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(5.0)
        assert asker.is_alive()  # still waiting: no 503 at once
        worker = _worker(redis_url, key_prefix, tmp_path / "worker.log")
        try:
            asker.join(90)
            assert not asker.is_alive(), worker.log()
        finally:
            worker.stop()
    response = got["response"]
    assert response.status_code == 200, response.text
    assert response.json()["rewards"] == pytest.approx([_noop_text("ab")])
    assert got["waited_s"] >= 5.0


def test_an_unknown_queue_is_refused_at_once_and_nothing_is_written(
    redis_url: str, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    r = redis.Redis.from_url(redis_url)
    other = f"{key_prefix}-served"
    r.xgroup_create(keys.job_streams(other)[0], keys.DEFAULT_GROUP, id="$", mkstream=True)
    with caplog.at_level(logging.WARNING), GatewayThread(redis_url, key_prefix) as g:
        started = time.monotonic()
        resp = requests.post(g.url + "/get_reward", json={"query": ["ab"]}, timeout=30)
        assert time.monotonic() - started < 5
        assert resp.status_code == 503
        error = resp.json()["error"]
        assert error["code"] == "unknown_queue" and f"{key_prefix!r}" in error["message"]
        assert other in error["message"]  # the queues there are
        health = requests.get(g.url + "/health", timeout=10)
        assert health.status_code == 200  # ready: Redis answers; the body says the queue is unknown
        assert health.json()["queue_state"] == {
            "known": False,
            "live_workers": 0,
            "consumer_group": False,
        }
        metrics = requests.get(g.url + "/metrics", timeout=10).text
        assert (
            'scoring_gateway_errors_total{code="unknown_queue",route="/get_reward"} 1.0' in metrics
        )
    assert r.exists(keys.job_streams(key_prefix)[0]) == 0  # no job was ever added
    assert r.keys(f"*{{{key_prefix}}}*") == []  # and no reply stream left
    warned = [x.getMessage() for x in caplog.records if "is unknown" in x.getMessage()]
    assert warned and key_prefix in warned[0] and other in warned[0]


def test_the_key_rides_in_the_url_as_http_basic(
    redis_url: str, key_prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    worker = _worker(redis_url, key_prefix, tmp_path / "worker.log")
    try:
        worker.wait_ready(60)
        with GatewayThread(redis_url, key_prefix, api_key=KEY) as g:
            host = g.url.removeprefix("http://")
            body = {"query": ["ab"]}
            # OpenRLHF's --reward.remote_url client: requests.post(url, json=...), no header
            ok = requests.post(f"http://openrlhf:{KEY}@{host}/get_reward", json=body, timeout=30)
            assert ok.status_code == 200, ok.text
            assert ok.json()["rewards"] == pytest.approx([_noop_text("ab")])
            # httpx (and aiohttp) turn the URL's userinfo into Basic too
            via_httpx = httpx.post(f"http://k:{KEY}@{host}/get_reward", json=body, timeout=30)
            assert via_httpx.status_code == 200, via_httpx.text
            header = requests.post(
                g.url + "/get_reward", json=body, headers={"X-API-Key": KEY}, timeout=30
            )
            assert header.status_code == 200
            with caplog.at_level(logging.WARNING, logger=middleware.__name__):
                bad = [
                    requests.post(f"http://k:wrong@{host}/get_reward", json=body, timeout=30),
                    requests.post(g.url + "/get_reward", json=body, timeout=30),
                    requests.post(g.url + "/get_reward", json=body, timeout=30),
                ]
            assert [b.status_code for b in bad] == [401, 401, 401]
            assert "http://k:<key>@host" in bad[1].json()["error"]["message"]
            refused = [x for x in caplog.records if "401 unauthorized" in x.getMessage()]
            assert len(refused) == 1  # rate-limited: one line for the three
            metrics = g.core.metrics.registry
            assert (
                metrics.get_sample_value("scoring_gateway_unauthorized_total", {"reason": "wrong"})
                == 1.0
            )
            assert (
                metrics.get_sample_value(
                    "scoring_gateway_unauthorized_total", {"reason": "missing"}
                )
                == 2.0
            )
    finally:
        worker.stop()


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ({b"authorization": b"Bearer abc"}, b"abc"),
        ({b"authorization": b"Basic dXNlcjphYmM="}, b"abc"),  # user:abc
        ({b"authorization": b"basic OmFiYw=="}, b"abc"),  # :abc, lower-case scheme
        ({b"authorization": b"Basic !!notbase64"}, b""),
        ({b"authorization": b"Token abc"}, b""),
        ({b"x-api-key": b"abc"}, b"abc"),
        ({}, None),
    ],
)
def test_presented_key(headers: dict[bytes, bytes], key: bytes | None) -> None:
    assert middleware.presented_key({"headers": list(headers.items())}) == key
