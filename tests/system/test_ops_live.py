"""A live worker subprocess seen from the outside, the way an operator's tools see it.

- ``/metrics`` parsed with prometheus-client's parser: every family the dashboard and the alert
  rules use is exported (labels included), and values move after good jobs, a bad job, an
  attention fallback (flash_attention_2 requested on a CPU machine) and a KV-cache rejection
  (a remote-code model that leaks ``past_key_values``);
- ``/healthz`` and ``/readyz`` during start, Redis loss and recovery, and drain after SIGTERM;
- a real Prometheus (Debian's ``prometheus``; skipped when missing) scrapes the worker and a
  gateway (``scoring-worker gateway`` behind an API key) in front of it, loads the alert rules, and
  every dashboard query returns data (the jobs include a GRPO group whose prompt the worker
  computes once, so the prefix-sharing panel shows a saving above 0).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tests.support.daemon import ROOT, WorkerProc, collect, enqueue, wait_until
from tests.support.models import tiny_causal
from tests.support.ops import (
    ALERTS,
    TARGET_LABELS,
    alert_rules,
    dashboard_queries,
    promql_refs,
    series_catalog,
    substitute_grafana,
)
from worker import keys
from worker.gateway.metrics import GatewayMetrics
from worker.processes.local import LocalWorker, free_port

pytestmark = [pytest.mark.redis, pytest.mark.slow]

PROMETHEUS = shutil.which("prometheus")
REDIS_SERVER = shutil.which("redis-server")
VOCAB = 128
GATEWAY_KEY = "ops-live-key"

LEAKY_MODELING = '''
"""A Llama whose backbone returns a KV cache whatever use_cache says (a misbehaving remote-code
model): the worker must reject the batch and count it."""
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache


class LeakyLlamaConfig(LlamaConfig):
    model_type = "leaky_llama"


class LeakyLlamaForCausalLM(LlamaForCausalLM):
    config_class = LeakyLlamaConfig

    def __init__(self, config):
        super().__init__(config)
        original = self.model.forward

        def forward(*args, **kwargs):
            out = original(*args, **kwargs)
            hidden = out.last_hidden_state
            kv = hidden.new_zeros(hidden.shape[0], 2, hidden.shape[1], 8)
            cache = DynamicCache(config=self.config)
            for layer in range(self.config.num_hidden_layers):
                cache.update(kv.clone(), kv.clone(), layer)
            out["past_key_values"] = cache
            return out

        self.model.forward = forward
'''


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama saved with save_pretrained."""
    path = tmp_path_factory.mktemp("tiny-llama")
    # the library's default initializer range (0.02), not the tests' 0.2
    tiny_causal("llama", 0, vocab=VOCAB, init_range=0.02).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def leaky_model(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama's weights under a remote-code class that leaks a KV cache."""
    path = tmp_path_factory.mktemp("leaky-llama")
    for f in Path(tiny_model).iterdir():
        shutil.copy(f, path / f.name)
    (path / "modeling_leaky.py").write_text(LEAKY_MODELING)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "leaky_llama"
    cfg["architectures"] = ["LeakyLlamaForCausalLM"]
    cfg["auto_map"] = {
        "AutoConfig": "modeling_leaky.LeakyLlamaConfig",
        "AutoModelForCausalLM": "modeling_leaky.LeakyLlamaForCausalLM",
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


# ----------------------------------------------------------------------------- helpers
def _get(url: str, timeout: float = 3.0, key: str | None = None) -> tuple[int, bytes]:
    """(status, body); status 0 when nothing answers. ``key``: sent as a bearer token."""
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=timeout
        ) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def _post(url: str, body: object, key: str | None = None) -> tuple[int, Any]:
    """POST ``body`` as JSON (with ``Authorization: Bearer key`` when given): (status, JSON)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def scrape(metrics_url: str, key: str | None = None) -> dict[str, Any]:
    """family name -> Metric, parsed by prometheus-client's own parser."""
    status, body = _get(metrics_url, key=key)
    assert status == 200
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def value(families: dict[str, Any], sample: str, **labels: str) -> float | None:
    """The value of the sample named ``sample`` whose labels include ``labels``."""
    for fam in families.values():
        for s in fam.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def total(families: dict[str, Any], sample: str, **labels: str) -> float:
    """Sum of every sample named ``sample`` matching ``labels``."""
    return sum(
        float(s.value)
        for fam in families.values()
        for s in fam.samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


def _worker_args(redis_url: str, queue: str, model: str, *extra: str) -> list[str]:
    return [
        "--redis-url", redis_url, "--queue", queue, "--reference-model", model,
        "--device", "cpu", "--dtype", "float32", "--metrics-port", "0", "--block-ms", "200",
        "--max-wait-ms", "2", *extra,
    ]  # fmt: skip


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[LocalWorker]]:
    started: list[LocalWorker] = []
    yield started
    for w in started:
        w.stop()


def _start(workers: list[LocalWorker], tmp_path: Path, args: list[str], **env: str) -> WorkerProc:
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", **env}
    w = WorkerProc(args, tmp_path / f"worker{len(workers)}.log", env=env)
    workers.append(w)
    return w


def _start_gateway(workers: list[LocalWorker], tmp_path: Path, redis_url: str, queue: str) -> str:
    """``scoring-worker gateway`` for ``queue`` behind ``GATEWAY_KEY``: its base URL once its
    ``/health`` answers."""
    port = free_port()
    args = [
        "--redis-url", redis_url, "--queue", queue, "--port", str(port),
        "--api-key", GATEWAY_KEY, "--window-ms", "20",
    ]  # fmt: skip
    gateway = LocalWorker(
        args,
        command="gateway",
        log_path=tmp_path / "gateway.log",
        env={"PYTHONUNBUFFERED": "1"},
        cwd=ROOT,
    )
    workers.append(gateway)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if gateway.poll() is not None:
            raise AssertionError(f"the gateway exited ({gateway.poll()}):\n{gateway.log()}")
        return _status(base + "/health") == 200

    wait_until(up, 60, 0.1, "gateway /health 200")
    return base


def _gateway_traffic(base: str, wave: int) -> int:
    """Concurrent scoring requests (coalesced into jobs for the worker), a 400 and a 401 for a
    missing and a wrong key; returns how many sequences were scored."""
    requests = [
        [
            [(11 * wave + 5 * i + 3 * j + k) % (VOCAB - 1) + 1 for k in range(5 + i)]
            for j in range(2)
        ]
        for i in range(4)
    ]
    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(
            pool.map(
                lambda prompt: _post(
                    base + "/v1/completions",
                    {"prompt": prompt, "prompt_logprobs": 0},
                    GATEWAY_KEY,
                ),
                requests,
            )
        )
    for (status, body), prompt in zip(answers, requests, strict=True):
        assert status == 200, body
        assert len(body["choices"]) == len(prompt)
    status, body = _post(
        base + "/v1/completions", {"prompt": "text", "prompt_logprobs": 0}, GATEWAY_KEY
    )
    assert status == 400 and body["error"]["code"] == "bad_request", body
    for key in (None, "wrong"):
        status, body = _post(
            base + "/v1/completions", {"prompt": [[1, 2]], "prompt_logprobs": 0}, key
        )
        assert status == 401 and body["error"]["code"] == "unauthorized", body
    return sum(len(p) for p in requests)


SHARED_PROMPT = 40  # over the worker's min_shared_tokens (32)


def _group_job(wave: int, g: int = 4) -> list[dict[str, Any]]:
    """A GRPO group: ``g`` completions (first ids all different) of one ``SHARED_PROMPT``-token
    prompt, which a worker with prefix sharing on computes once."""
    prompt = [(13 * wave + 7 * k) % (VOCAB - 1) + 1 for k in range(SHARED_PROMPT)]
    return [
        {"tokens": prompt + [i + 1] + [(5 * i + k) % (VOCAB - 1) + 1 for k in range(2 + i)],
         "prompt_len": SHARED_PROMPT}
        for i in range(g)
    ]  # fmt: skip


def _good_jobs(n: int) -> list[tuple[str, list[dict[str, Any]]]]:
    return [
        (
            f"ok-{i}",
            [{"tokens": [(7 * i + k) % (VOCAB - 1) + 1 for k in range(6 + i)], "prompt_len": 2}],
        )
        for i in range(n)
    ]


# ----------------------------------------------------------------------------- metrics
def _assert_referenced_families_exported(families: dict[str, Any]) -> None:
    """Every series used by the dashboard/alerts belongs to an exported family, and each label
    they use appears on that family's samples (when it has samples yet). The gateway's series
    (its panels) are the gateway process's: checked against the families it registers."""
    gateway = {m.name: m for m in GatewayMetrics(CollectorRegistry()).registry.collect()}
    families = {**gateway, **families}
    catalog = series_catalog()
    exprs = [substitute_grafana(e) for _, e in dashboard_queries()]
    exprs += [r["expr"] for r in alert_rules()]
    sample_labels: dict[str, set[str]] = {}
    for fam in families.values():
        for s in fam.samples:
            sample_labels.setdefault(s.name, set()).update(s.labels)
    exported = {name for name in families}
    for expr in exprs:
        refs = promql_refs(expr)
        for series, labels in refs.metrics.items():
            if not series or series == "up":
                continue
            family = catalog[series][0]
            # the parser names an Info family `x_info` and a counter `x` (samples `x_total`)
            assert family in exported or series in exported, f"{series} not exported ({expr})"
            if series in sample_labels:
                missing = labels - sample_labels[series] - TARGET_LABELS
                assert not missing, f"{series} lacks labels {missing} on the live worker"


@pytest.mark.timeout(180)
def test_live_metrics_move_after_jobs_fallback_and_bad_job(
    redis_url: str,
    key_prefix: str,
    cleanup_keys: None,
    tiny_model: str,
    tmp_path: Path,
    workers: list[LocalWorker],
) -> None:
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "ops")
    w = _start(
        workers,
        tmp_path,
        _worker_args(redis_url, key_prefix, tiny_model, "--attention-backend", "flash_attention_2"),
    ).wait_ready()
    url = w.metrics_url
    before = scrape(url)
    _assert_referenced_families_exported(before)
    assert value(before, "scoring_worker_up") == 1.0
    assert value(before, "scoring_worker_ready") == 1.0
    assert value(before, "scoring_jobs_total", outcome="ok") == 0.0
    (build,) = before["scoring_build_info"].samples
    assert build.labels["model"] and build.labels["torch"] and build.labels["version"]
    assert build.labels["device"] == "cpu"

    # the fallback: flash_attention_2 cannot run here, so the worker says so with a reason
    fallbacks = [
        s
        for s in before["scoring_attention_fallbacks"].samples
        if s.name == "scoring_attention_fallbacks_total"
    ]
    assert fallbacks, "requesting flash_attention_2 on CPU must count a fallback"
    (fb,) = fallbacks
    assert fb.labels["requested"] == "flash_attention_2" and fb.value >= 1
    assert fb.labels["used"] in ("sdpa", "eager") and fb.labels["reason"]
    assert " " not in fb.labels["reason"], "reason is a short class, not a message"
    assert value(before, "scoring_attention_backend_active", backend=fb.labels["used"]) == 1.0

    client = redis.Redis.from_url(redis_url)
    jobs = _good_jobs(3)
    for job_id, seqs in jobs:
        enqueue(client, stream, job_id, reply, seqs)
    enqueue(client, stream, "bad-1", reply, [{"tokens": [1, 2, VOCAB + 50], "prompt_len": 1}])
    got, _ = collect(client, reply, [j for j, _ in jobs] + ["bad-1"], timeout=60)
    assert got["bad-1"].code == "bad_request"

    real_tokens = sum(len(s[0]["tokens"]) for _, s in jobs)
    scored = sum(len(s[0]["tokens"]) - 2 for _, s in jobs)

    def moved() -> dict[str, Any] | None:
        fams = scrape(url)
        done = total(fams, "scoring_jobs_total")
        return (
            fams if done >= 4 and value(fams, "scoring_stream_consumers", stream=stream) else None
        )

    after = wait_until(moved, 15, 0.2, "job counters and stream gauges")
    assert value(after, "scoring_jobs_total", outcome="ok") == 3.0
    assert value(after, "scoring_jobs_total", outcome="bad_request") == 1.0
    assert value(after, "scoring_sequences_total") == 3.0
    assert value(after, "scoring_tokens_total") == real_tokens
    assert value(after, "scoring_scored_tokens_total") == scored
    assert value(after, "scoring_batches_total") >= 1  # type: ignore[operator]
    assert value(after, "scoring_forward_seconds_count") == value(after, "scoring_batches_total")
    assert value(after, "scoring_end_to_end_seconds_count") == 4.0
    assert value(after, "scoring_queue_wait_seconds_count") == 4.0
    assert value(after, "scoring_batch_tokens_sum") == real_tokens
    assert value(after, "scoring_last_batch_peak_allocated_bytes") > 0  # type: ignore[operator]
    assert value(after, "scoring_device_memory_total_bytes") > 2**30  # type: ignore[operator]
    assert value(after, "scoring_last_batch_timestamp_seconds") > time.time() - 60  # type: ignore[operator]
    assert value(after, "scoring_kv_outputs_rejected_total") == 0.0
    assert value(after, "scoring_stream_lag", stream=stream, group="scoring") == 0.0
    assert value(after, "scoring_stream_pending", stream=stream, group="scoring") == 0.0
    assert value(after, "scoring_stream_consumers", stream=stream, group="scoring") == 1.0
    dead = keys.dead_letter_stream(stream)
    assert value(after, "scoring_dead_letter_length", stream=dead) == 0.0
    _assert_referenced_families_exported(after)


@pytest.mark.timeout(180)
def test_live_kv_cache_rejection_is_counted(
    redis_url: str,
    key_prefix: str,
    cleanup_keys: None,
    leaky_model: str,
    tmp_path: Path,
    workers: list[LocalWorker],
) -> None:
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "ops")
    w = _start(
        workers, tmp_path, _worker_args(redis_url, key_prefix, leaky_model, "--trust-remote-code")
    ).wait_ready()
    url = w.metrics_url
    assert value(scrape(url), "scoring_kv_outputs_rejected_total") == 0.0
    client = redis.Redis.from_url(redis_url)
    enqueue(client, stream, "kv-1", reply, _good_jobs(1)[0][1])
    got, _ = collect(client, reply, ["kv-1"], timeout=60)
    res = got["kv-1"]
    assert res.code == "internal" and "KV cache" in res.error["message"]  # type: ignore[index]
    fams = wait_until(
        lambda: (f := scrape(url)) and value(f, "scoring_jobs_total", outcome="internal") and f,
        10,
        0.2,
        "internal outcome counted",
    )
    assert value(fams, "scoring_kv_outputs_rejected_total") == 1.0
    assert value(fams, "scoring_jobs_total", outcome="ok") == 0.0
    assert value(scrape(url), "scoring_worker_up") == 1.0  # the worker keeps serving


# ----------------------------------------------------------------------------- health
class OwnRedis:
    """A redis-server this test can stop and restart on the same port."""

    def __init__(self, port: int, workdir: Path) -> None:
        self.port, self.workdir = port, workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> OwnRedis:
        assert REDIS_SERVER is not None
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_until(lambda: self._ping(), 10, 0.05, "redis-server up")
        return self

    def _ping(self) -> bool:
        try:
            return bool(redis.Redis(port=self.port, socket_connect_timeout=0.2).ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server not installed")
    server = OwnRedis(free_port(), tmp_path).start()
    try:
        yield server
    finally:
        server.stop()


def _status(url: str) -> int:
    return _get(url, timeout=2)[0]


@pytest.mark.timeout(120)
def test_health_during_start_and_redis_loss(
    own_redis: OwnRedis, tiny_model: str, tmp_path: Path, workers: list[LocalWorker]
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = _worker_args(own_redis.url, "health", tiny_model)
    args[args.index("--metrics-port") + 1] = str(port)
    w = _start(workers, tmp_path, args)
    seen_before_ready: set[int] = set()
    startup_before_ready: list[int] = []

    def ready() -> bool:
        startup_before_ready.append(_status(base + "/startupz"))
        code = _status(base + "/readyz")
        if code != 200:
            seen_before_ready.add(code)
        return code == 200

    wait_until(ready, 90, 0.05, "readyz 200")
    # Not ready while importing torch and loading the model (refused or 503), and 200 only once
    # the worker has connected and serves.
    assert seen_before_ready and seen_before_ready <= {0, 503}
    assert "serving" in w.log()
    assert _status(base + "/healthz") == 200
    # /startupz: refused or 503 until the model is loaded, then 200 for good (never back to 503)
    assert set(startup_before_ready) <= {0, 503, 200}
    first_ok = startup_before_ready.index(200) if 200 in startup_before_ready else None
    if first_ok is not None:
        assert set(startup_before_ready[first_ok:]) == {200}
    assert _status(base + "/startupz") == 200
    reconnects = value(scrape(base + "/metrics"), "scoring_redis_reconnects_total")

    own_redis.stop()
    wait_until(lambda: _status(base + "/readyz") == 503, 15, 0.1, "readyz 503 without Redis")
    _, body = _get(base + "/readyz")
    assert json.loads(body)["redis_ok"] is False
    assert _status(base + "/healthz") == 200  # alive: restarting the pod would not help
    assert _status(base + "/startupz") == 200  # started up: the startup probe is done for good
    fams = scrape(base + "/metrics")
    assert value(fams, "scoring_redis_reconnects_total") > reconnects  # type: ignore[operator]

    own_redis.start()
    wait_until(lambda: _status(base + "/readyz") == 200, 20, 0.1, "readyz 200 after restart")
    assert json.loads(_get(base + "/readyz")[1])["redis_ok"] is True


@pytest.mark.timeout(120)
def test_drain_flips_readiness_and_finishes_the_batch(
    redis_url: str,
    key_prefix: str,
    cleanup_keys: None,
    tmp_path: Path,
    workers: list[LocalWorker],
) -> None:
    """SIGTERM during a slow batch: /readyz goes 503 (draining) while the batch finishes, the
    result is written, and the worker exits 0. ``--no-handback``: the job is seen in flight once
    it is read, before its batch starts; a worker that hands back what it has not started would
    then give it back and exit at once (tests/faults: the hand-back scenario), and this test's
    SIGTERM must land in a batch whatever the moment."""
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "ops")
    args = [
        "--redis-url", redis_url, "--queue", key_prefix, "--scorer", "noop",
        "--noop-delay-ms", "3000", "--metrics-port", "0", "--block-ms", "200", "--no-handback",
    ]  # fmt: skip
    w = _start(workers, tmp_path, args).wait_ready()
    base = w.metrics_url.rsplit("/", 1)[0]
    assert _status(base + "/readyz") == 200
    client = redis.Redis.from_url(redis_url)
    enqueue(client, stream, "slow-1", reply, [{"tokens": [1, 2, 3, 4], "prompt_len": 1}])
    wait_until(
        lambda: (
            value(scrape(base + "/metrics"), "scoring_in_flight_jobs") == 1.0
            or client.xpending(stream, "scoring")["pending"] == 1
        ),
        10,
        0.05,
        "job in flight",
    )
    w.signal(signal.SIGTERM)
    wait_until(lambda: _status(base + "/readyz") == 503, 2, 0.02, "readyz 503 while draining")
    body = json.loads(_get(base + "/readyz")[1])
    assert body["draining"] is True
    assert value(scrape(base + "/metrics"), "scoring_worker_draining") == 1.0
    assert w.wait_exit(30) == 0
    got, _ = collect(client, reply, ["slow-1"], timeout=5)
    assert got["slow-1"].error is None
    assert client.xpending(stream, "scoring")["pending"] == 0


# ----------------------------------------------------------------------------- Prometheus
@pytest.mark.skipif(
    PROMETHEUS is None,
    reason="prometheus not installed (apt-get install -y --no-install-recommends prometheus)",
)
@pytest.mark.timeout(150)
def test_real_prometheus_scrapes_worker_and_every_dashboard_query_has_data(
    redis_url: str,
    key_prefix: str,
    cleanup_keys: None,
    tiny_model: str,
    tmp_path: Path,
    workers: list[LocalWorker],
) -> None:
    assert PROMETHEUS is not None
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "ops")
    # flash_attention_2 on CPU falls back, so the fallback panel has data too
    args = _worker_args(
        redis_url, key_prefix, tiny_model, "--attention-backend", "flash_attention_2"
    )
    w = _start(workers, tmp_path, args).wait_ready()
    target = urllib.parse.urlsplit(w.metrics_url).netloc
    # the gateway in front of the worker's queue, its /metrics behind its key like ops/prometheus
    gateway = _start_gateway(workers, tmp_path, redis_url, key_prefix)
    gateway_target = urllib.parse.urlsplit(gateway).netloc
    prom_port = free_port()
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": ["alerts.yml"],
                "scrape_configs": [
                    {"job_name": "scoring-worker", "static_configs": [{"targets": [target]}]},
                    {
                        "job_name": "scoring-gateway",
                        "authorization": {"credentials": GATEWAY_KEY},
                        "static_configs": [{"targets": [gateway_target]}],
                    },
                ],
            }
        )
    )
    prom_log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    prom = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=prom_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    api = f"http://127.0.0.1:{prom_port}/api/v1"

    def query(expr: str) -> list[Any]:
        qs = urllib.parse.urlencode({"query": expr})
        code, body = _get(f"{api}/query?{qs}", timeout=5)
        doc = json.loads(body or b"{}")
        assert code == 200 and doc.get("status") == "success", (expr, code, body[:300])
        return list(doc["data"]["result"])

    try:
        wait_until(
            lambda: _status(f"http://127.0.0.1:{prom_port}/-/ready") == 200,
            30,
            0.2,
            "prometheus ready",
        )
        for up in ('up{job="scoring-worker"} == 1', 'up{job="scoring-gateway"} == 1'):
            wait_until(lambda up=up: query(up), 20, 0.5, up)
        client = redis.Redis.from_url(redis_url)
        gateway_sequences = 0
        for wave in range(2):  # two waves so rates see increases between scrapes
            ids = []
            for job_id, seqs in [*_good_jobs(4), ("group", _group_job(wave))]:
                ids.append(f"{job_id}-{wave}")
                enqueue(client, stream, ids[-1], reply, seqs)
            got, _ = collect(client, reply, ids, timeout=60)
            # the group's prompt ran once for its 4 completions (the prefix-sharing panels)
            assert got[f"group-{wave}"].info["shared_tokens"] == SHARED_PROMPT * 4
            gateway_sequences += _gateway_traffic(gateway, wave)
            time.sleep(2)
        fams = scrape(gateway + "/metrics", key=GATEWAY_KEY)
        assert value(fams, "scoring_gateway_sequences_total") == gateway_sequences
        assert 1 <= value(fams, "scoring_gateway_jobs_total") <= gateway_sequences  # type: ignore[operator]
        assert value(fams, "scoring_gateway_unauthorized_total", reason="missing") == 2
        assert value(fams, "scoring_gateway_unauthorized_total", reason="wrong") == 2
        assert total(fams, "scoring_gateway_errors_total", code="bad_request") == 2
        # gauges sampled every few seconds, rates need two scrapes after the jobs
        wait_until(lambda: query("scoring_stream_lag"), 20, 0.5, "stream gauges scraped")
        time.sleep(2)

        empty = []
        for title, expr in dashboard_queries():
            promql = substitute_grafana(expr, window="1m")
            if not query(promql):
                empty.append((title, promql))
        assert not empty, f"dashboard queries without data: {empty}"
        # the prefix-sharing panel shows the saving of the groups' prompts
        (saving,) = [
            e for t, e in dashboard_queries() if t == "Prefix sharing: backbone tokens saved"
        ]
        (sample,) = query(substitute_grafana(saving, window="1m"))
        assert float(sample["value"][1]) > 0, sample

        _, body = _get(f"{api}/rules")
        groups = json.loads(body)["data"]["groups"]
        loaded = {r["name"]: r for g in groups for r in g["rules"]}
        assert set(loaded) == {r["alert"] for r in alert_rules()}
        wait_until(
            lambda: all(
                r.get("health") == "ok"
                for g in json.loads(_get(f"{api}/rules")[1])["data"]["groups"]
                for r in g["rules"]
            ),
            10,
            0.5,
            "alert rules evaluated without errors",
        )
        firing = query('ALERTS{alertstate="firing"}')
        assert not firing, f"a healthy worker fires alerts: {firing}"
    finally:
        prom.terminate()
        try:
            prom.wait(10)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait(5)
        prom_log.close()
