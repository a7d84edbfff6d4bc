"""What a new user meets in the first hour, each answered within seconds and in a line or two:
configuration errors without a traceback, a mistyped model path, a wrong queue name, a metrics
port in use, client-side input errors in the documented error tree, and ``enqueue`` telling the
truth on resume."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support.daemon import WorkerProc
from worker.client import BadRequestError, JobFailed, ScoringClient, UnknownQueueError
from worker.demo.tiny import save_tiny_models
from worker.errors import ConfigError
from worker.executor.weights import source
from worker.processes.local import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.redis


def _cli(*argv: str, cwd: Path = ROOT, env: dict[str, str] | None = None, timeout: float = 60):
    return subprocess.run(
        [sys.executable, "-m", "worker", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding ``models/tiny-llama`` and ``models/tiny-reward`` (demo --save-models)."""
    root = tmp_path_factory.mktemp("first-hour")
    save_tiny_models(root / "models")
    return root


@pytest.fixture
def reference_worker(
    redis_url: str, key_prefix: str, models: Path, tmp_path: Path
) -> Iterator[WorkerProc]:
    """A reference-only worker on the test's queue."""
    worker = WorkerProc(
        ["--redis-url", redis_url, "--queue", key_prefix, "--metrics-port", "0",
         "--reference-model", str(models / "models" / "tiny-llama"), "--block-ms", "100"],
        tmp_path / "worker.log",
    )  # fmt: skip
    try:
        yield worker.wait_ready()
    finally:
        worker.signal(15)
        worker.wait_exit(30)
        worker.stop()


# ----------------------------------------------------------------------------- start-up errors


def test_a_configuration_error_is_two_lines_and_exit_2(redis_url: str) -> None:
    proc = _cli("serve", "--redis-url", redis_url, "--metrics-port", "-1")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == (
        "error: serve needs --reference-model and/or --reward-model (or --scorer noop)"
    )
    assert len(lines) == 2 and "--save-models" in lines[1]
    assert "Traceback" not in proc.stderr


def test_debug_shows_the_traceback(redis_url: str) -> None:
    proc = _cli("--debug", "serve", "--redis-url", redis_url, "--metrics-port", "-1")
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr and "ConfigError" in proc.stderr


def test_a_mistyped_model_folder_is_named_with_the_likely_one(models: Path) -> None:
    proc = _cli("serve", "--reference-model", "models/tiny-lama", cwd=models, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert "error: --reference-model models/tiny-lama: no such file or directory" in proc.stderr
    assert "did you mean models/tiny-llama?" in proc.stderr
    assert "Traceback" not in proc.stderr and "huggingface.co" not in proc.stderr


def test_a_missing_absolute_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "model"
    proc = _cli("serve", "--reward-model", str(missing), timeout=30)
    assert proc.returncode == 2
    assert f"error: --reward-model {missing}: no such file or directory" in proc.stderr


def test_a_hub_id_while_offline_names_the_id_and_the_variable(tmp_path: Path) -> None:
    proc = _cli("serve", "--reference-model", "some-org/not-cached", cwd=tmp_path, timeout=30,
                env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "'some-org/not-cached'" in proc.stderr and "HF_HUB_OFFLINE" in proc.stderr


def test_an_unreachable_hub_is_refused_without_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens
    monkeypatch.setattr(source, "offline", lambda: False)
    with pytest.raises(ConfigError, match=r"'org/model' is not a local path.*does not answer"):
        source.check_model_source("org/model", flag="--reference-model")


@pytest.mark.parametrize(
    "name, local",
    [("/abs/path", True), ("./rel", True), ("../up", True), ("a/b/c", True), ("x.gguf", True),
     ("~/m", True), ("bad name", True), ("org/model", False), ("gpt2", False),
     ("HuggingFaceTB/SmolLM2-135M", False)],
)  # fmt: skip
def test_what_counts_as_a_local_path(name: str, local: bool) -> None:
    assert source.looks_local(name) is local


def test_a_taken_metrics_port_names_the_port_and_the_flag(redis_url: str) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _cli("serve", "--scorer", "noop", "--redis-url", redis_url,
                    "--metrics-port", str(port), "--burst")  # fmt: skip
    assert proc.returncode == 2
    assert f"error: --metrics-port {port}: 127.0.0.1:{port} is already in use" in proc.stderr
    assert "--metrics-port" in proc.stderr.splitlines()[1] and "Traceback" not in proc.stderr


def test_an_unreachable_redis_is_one_line() -> None:
    proc = _cli("info", "--redis-url", f"redis://127.0.0.1:{free_port()}/0", timeout=30)
    assert proc.returncode in (1, 2) and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ")


# ----------------------------------------------------------------------------- no silent waits


@pytest.mark.usefixtures("cleanup_keys")
def test_the_client_refuses_a_queue_nobody_ever_served(redis_url: str, key_prefix: str) -> None:
    r = redis.Redis.from_url(redis_url)
    r.xadd(f"scoring:{{{key_prefix}-real}}:jobs", {"x": "1"})  # another queue, listed
    with ScoringClient(redis_url, queue=key_prefix) as client:
        start = time.monotonic()
        with pytest.raises(UnknownQueueError) as info:
            client.score([([1, 2, 3], 1)], timeout=60)
        assert time.monotonic() - start < 5  # at once, not after the timeout
        assert client.live_workers() == 0
    assert info.value.code == "unknown_queue" and f"{key_prefix}-real" in (info.value.queues or [])
    assert f"no worker serves queue {key_prefix!r}" in str(info.value)
    assert r.exists(f"scoring:{{{key_prefix}}}:jobs") == 0  # nothing was written
    r.delete(f"scoring:{{{key_prefix}-real}}:jobs")


@pytest.mark.usefixtures("cleanup_keys")
def test_the_client_sees_a_live_worker(
    redis_url: str, key_prefix: str, reference_worker: WorkerProc, caplog: pytest.LogCaptureFixture
) -> None:
    with ScoringClient(redis_url, queue=key_prefix) as client, caplog.at_level(logging.INFO):
        assert client.score([([1, 5, 6, 7], 1)], timeout=60)[0].logps.shape == (3,)
        assert client.live_workers() == 1
        assert client.queue_state().known is True
    assert not [r for r in caplog.records if "no worker serves" in r.getMessage()]


@pytest.mark.usefixtures("cleanup_keys")
def test_enqueue_refuses_an_unknown_queue_at_once(
    redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"tokens": [1, 2, 3], "prompt_len": 1}) + "\n")
    out = tmp_path / "out.jsonl"
    for extra in ((), ("--wait-for-workers", "1")):
        proc = _cli("enqueue", "--redis-url", redis_url, "--queue", key_prefix, "--file",
                    str(src), "--out", str(out), *extra, timeout=30)  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert f"error: no worker serves queue {key_prefix!r} and none ever did" in proc.stderr
        assert "nothing was submitted" in proc.stderr and "--wait-for-workers" in proc.stderr
    assert redis.Redis.from_url(redis_url).exists(f"scoring:{{{key_prefix}}}:jobs") == 0


def test_info_on_an_unknown_queue_names_it(redis_url: str) -> None:
    proc = _cli("info", "--redis-url", redis_url, "--queue", "no-such-queue-7f3a")
    assert proc.returncode == 2
    assert "error: no queue 'no-such-queue-7f3a'" in proc.stderr and "queues there:" in proc.stderr


# ----------------------------------------------------------------------------- one error tree


def test_client_side_errors_are_bad_request_errors(redis_url: str, key_prefix: str) -> None:
    with ScoringClient(redis_url, queue=key_prefix) as client:
        for bad in ([([1, 2, 3], 5)], [], [{"tokens": [1, 2]}], [("x", 1)]):
            with pytest.raises(BadRequestError) as info:
                client.submit(bad)
            assert isinstance(info.value, JobFailed) and info.value.code == "bad_request"
            assert info.value.sent is False and "was not sent" in str(info.value)
        with pytest.raises(BadRequestError):
            list(client.score_many([[([1, 2, 3], 9)]], timeout=5))


# ----------------------------------------------------------------------------- enqueue resume


@pytest.mark.usefixtures("cleanup_keys")
def test_enqueue_resume_counts_earlier_failures_and_retry_replaces_them(
    redis_url: str, key_prefix: str, reference_worker: WorkerProc, tmp_path: Path
) -> None:
    src = tmp_path / "in.jsonl"
    lines = [
        {"id": "ok-1", "tokens": [1, 5, 6], "prompt_len": 1},
        {"id": "rw-1", "tokens": [1, 5, 6], "prompt_len": 1, "mode": "reward"},
        {"id": "ok-2", "tokens": [1, 7, 8, 9], "prompt_len": 2},
    ]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    args = ("enqueue", "--redis-url", redis_url, "--queue", key_prefix, "--file", str(src),
            "--out", str(out), "--no-progress")  # fmt: skip
    first = _cli(*args)
    assert first.returncode == 1, first.stderr  # a reference-only worker: the reward line fails
    assert "2 scored, 1 failed" in first.stderr
    again = _cli(*args)
    assert again.returncode == 1, again.stderr  # the output still holds an error line
    assert "0 scored, 0 failed; earlier runs: 2 scored, 1 failed" in again.stderr
    retried = _cli(*args, "--retry-errors")
    assert retried.returncode == 1 and "0 scored, 1 failed" in retried.stderr
    ids = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert sorted(ids) == ["ok-1", "ok-2", "rw-1"]  # one line per id
