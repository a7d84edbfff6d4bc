"""The HTTP gateway against a real no-op worker (``serve --scorer noop``) and a real Redis:
auth, the error table, limits, coalescing of concurrent one-sample requests, and the service
routes. Values against real models: ``tests/gateway/test_peers.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import requests

from tests.support.daemon import WorkerProc
from tests.support.gateway import GatewayThread
from worker.gateway.errors import HTTP_STATUS

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

KEY = "s3cret"


@pytest.fixture(scope="module")
def noop_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A no-op worker on its own queue: ``(redis_url, queue)``."""
    import uuid

    from tests.conftest import MACHINE_REDIS_URL

    queue = f"gw{uuid.uuid4().hex[:10]}"
    log = tmp_path_factory.mktemp("gw") / "worker.log"
    worker = WorkerProc(
        [
            "--redis-url",
            MACHINE_REDIS_URL,
            "--queue",
            queue,
            "--scorer",
            "noop",
            "--consumer",
            "w1",
            "--metrics-port",
            "0",
        ],
        log,
    )
    try:
        worker.wait_ready(60)
        yield MACHINE_REDIS_URL, queue
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def gateway(noop_worker: tuple[str, str]) -> Iterator[GatewayThread]:
    url, queue = noop_worker
    with GatewayThread(url, queue, api_key=KEY, max_body_bytes=1 << 20, window_ms=5) as g:
        yield g


def _post(g: GatewayThread, path: str, body: object, key: str | None = KEY) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(g.url + path, json=body, headers=headers, timeout=30)


def test_every_error_code_has_a_status_and_the_table_covers_the_wire_codes() -> None:
    from worker.errors import ERROR_CODES

    assert set(ERROR_CODES) <= set(HTTP_STATUS)
    assert HTTP_STATUS["bad_request"] == 400 and HTTP_STATUS["unauthorized"] == 401
    assert HTTP_STATUS["model_not_found"] == 404 and HTTP_STATUS["too_long"] == 413
    assert HTTP_STATUS["unknown_queue"] == 503 and HTTP_STATUS["timeout"] == 504


@pytest.mark.parametrize("key", [None, "wrong"])
def test_missing_or_wrong_key_is_401_and_scores_nothing(
    gateway: GatewayThread, key: str | None
) -> None:
    before = gateway.core.coalescer.jobs
    for path, body in [
        ("/get_reward", {"query": ["ab"]}),
        ("/reward", {"prompt": "a", "response": "b"}),
        ("/v1/completions", {"prompt": [[1, 2]], "prompt_logprobs": 0}),
    ]:
        r = _post(gateway, path, body, key=key)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "unauthorized"
    assert requests.get(gateway.url + "/v1/models", timeout=10).status_code == 401
    assert requests.get(gateway.url + "/health", timeout=10).status_code == 200  # no key needed
    assert requests.get(gateway.url + "/health/", timeout=10).status_code == 200
    assert gateway.core.coalescer.jobs == before


def test_empty_lists_get_empty_answers(gateway: GatewayThread) -> None:
    r = _post(gateway, "/get_reward", {"query": [], "prompts": [], "labels": []})
    assert r.status_code == 200 and r.json() == {"rewards": [], "scores": [], "extra_logs": {}}
    r = _post(gateway, "/classify", {"input": []})
    assert r.status_code == 200 and r.json()["data"] == []


@pytest.mark.parametrize(
    ("path", "body", "code", "match"),
    [
        ("/get_reward", b"{not json", "bad_request", "invalid request body"),
        ("/get_reward", {"query": "one string"}, "bad_request", "query"),
        (
            "/v1/completions",
            {"prompt": [[1, 2]], "max_tokens": 2, "prompt_logprobs": 1},
            "bad_request",
            "max_tokens=2",
        ),
        ("/v1/completions", {"prompt": "text", "prompt_logprobs": 1}, "bad_request", "token ids"),
        ("/v1/completions", {"prompt": [[1, 2]]}, "bad_request", "prompt_logprobs"),
        (
            "/v1/completions",
            {"prompt": [[1, 2]], "prompt_logprobs": 1, "stream": True},
            "bad_request",
            "stream",
        ),
        ("/v1/completions", {"prompt": [[1, -2]], "prompt_logprobs": 1}, "bad_request", "prompt"),
        (
            "/inference/v1/generate",
            {"token_ids": [1, 2], "sampling_params": {"max_tokens": 4, "prompt_logprobs": 1}},
            "bad_request",
            "max_tokens=4",
        ),
        (
            "/generate",
            {
                "input_ids": [1, 2],
                "sampling_params": {"max_new_tokens": 8},
                "return_logprob": True,
                "logprob_start_len": 0,
            },
            "bad_request",
            "max_new_tokens=8",
        ),
        (
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}},
            "bad_request",
            "return_logprob",
        ),
        (
            "/classify",
            {"input": "x", "messages": [{"role": "user", "content": "x"}]},
            "bad_request",
            "exactly one",
        ),
        ("/nowhere", {}, "not_found", "/nowhere"),
    ],
)
def test_bad_requests_are_400_before_any_work(
    gateway: GatewayThread, path: str, body: object, code: str, match: str
) -> None:
    before = gateway.core.coalescer.jobs
    if isinstance(body, bytes):
        r = requests.post(
            gateway.url + path, data=body, timeout=10, headers={"Authorization": f"Bearer {KEY}"}
        )
    else:
        r = _post(gateway, path, body)
    assert r.status_code == HTTP_STATUS[code], r.text
    err = r.json()["error"]
    assert err["code"] == code and match in err["message"], err
    assert r.headers["x-scoring-error"] == code
    assert gateway.core.coalescer.jobs == before


def test_body_over_the_limit_is_413(gateway: GatewayThread) -> None:
    r = _post(gateway, "/get_reward", {"query": ["x" * (2 << 20)]})
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"


def test_a_bad_sequence_fails_only_its_own_request(gateway: GatewayThread) -> None:
    """Coalesced with good requests into one job, an out-of-vocabulary id fails that job; the
    batch is split and only the culprit gets the 400."""

    async def run() -> list[httpx.Response]:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=gateway.url, headers=headers, timeout=30) as c:
            bodies = [{"prompt": [[1, 2, 3 + i]], "prompt_logprobs": 0} for i in range(6)]
            bodies[3] = {"prompt": [[1, 2, 40_000]], "prompt_logprobs": 0}  # noop vocab: 32000
            return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

    splits = gateway.core.coalescer.splits
    answers = asyncio.run(run())
    assert [a.status_code for a in answers] == [200, 200, 200, 400, 200, 200]
    assert "vocab" in answers[3].json()["error"]["message"] or "outside" in answers[3].text
    assert gateway.core.coalescer.splits > splits


def test_two_thousand_concurrent_one_sample_requests_are_coalesced(
    gateway: GatewayThread,
) -> None:
    """2,000 one-sample requests on 500 connections (no thread each on either side): all
    answered, each with its own reward, in far fewer jobs than requests."""
    import json

    from worker.devtools.bench.gateway import http_load

    n = 2000
    bodies = [
        json.dumps({"query": [f"q{i}"], "prompts": [""], "labels": [0]}).encode() for i in range(n)
    ]
    jobs = gateway.core.coalescer.jobs
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    _, latencies, answers = asyncio.run(http_load(gateway.port, "/get_reward", bodies, 500, auth))
    for i, a in enumerate(answers):  # the noop reward of text: its bytes' sum mod 1000 / 1000
        want = (sum(f"q{i}".encode()) % 1000) / 1000
        assert json.loads(a)["rewards"] == [pytest.approx(want)]
    assert gateway.core.coalescer.jobs - jobs < n / 10  # many requests per job
    assert max(latencies) < 30


def test_service_routes(gateway: GatewayThread) -> None:
    h = {"Authorization": f"Bearer {KEY}"}
    models = requests.get(gateway.url + "/v1/models", headers=h, timeout=10).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "noop"
    text = requests.get(gateway.url + "/metrics", headers=h, timeout=10).text
    assert 'scoring_gateway_requests_total{route="/get_reward",status="200"}' in text
    assert 'scoring_gateway_errors_total{code="unauthorized"' in text
    assert "scoring_gateway_in_flight" in text and "scoring_gateway_jobs_total" in text


@pytest.mark.usefixtures("cleanup_keys")
def test_unknown_queue_is_503_and_no_answer_in_time_is_504(redis_url: str, key_prefix: str) -> None:
    with GatewayThread(redis_url, key_prefix) as g:  # no worker ever served the queue
        r = requests.post(g.url + "/reward", json={"prompt": "a", "response": "b"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "unknown_queue"
    with GatewayThread(redis_url, key_prefix, allow_unknown_queue=True, timeout_s=0.5) as g:
        r = requests.post(g.url + "/reward", json={"prompt": "a", "response": "b"}, timeout=10)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert f"no worker served queue {key_prefix!r}" in r.json()["error"]["message"]


def test_gateway_command_fails_cleanly_on_start_up_errors(tmp_path: Path) -> None:
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "worker", "gateway", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    bad = run("--redis-url", "redis://127.0.0.1:1/0")
    assert bad.returncode == 2 and bad.stderr.startswith("error: cannot reach Redis")
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) <= 2
    neg = run("--timeout-s", "-1")
    assert neg.returncode == 2 and neg.stderr.startswith("error: bad gateway setting")
    help_text = run("--help").stdout
    for flag in ("--host", "--port", "--api-key", "--redis-url", "--queue", "--timeout-s"):
        assert flag in help_text
    assert "SCORING_GATEWAY_API_KEY" in help_text and "default 127.0.0.1" in help_text
