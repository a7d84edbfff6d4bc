"""``--log-json``: ``cli.JsonFormatter`` writes one JSON object per line (ts, level, logger, msg,
structured ``fields``, exc), and a worker started with ``--log-json`` (the real ``main``,
in-process, on one job) logs nothing but JSON lines, among them the one line per batch."""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterator

import pytest
import redis

from tests.support.daemon import enqueue
from worker import keys
from worker.cli import JsonFormatter, build_parser, main

TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
KEYS = {"ts", "level", "logger", "msg"}


@pytest.fixture
def root_logging() -> Iterator[None]:
    """Put the root logger back as it was (``setup_logging`` replaces its handlers)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def _record(msg: str, *args: object, exc: bool = False, **extra: object) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    record = logging.LogRecord("worker.test", logging.WARNING, __file__, 1, msg, args, exc_info)
    record.__dict__.update(extra)
    return record


def test_json_formatter_one_object_per_record() -> None:
    fmt = JsonFormatter()
    line = fmt.format(_record("batch: %d jobs, %s", 3, 'quote " and\nnewline'))
    assert "\n" not in line  # one physical line even when the message has a newline
    obj = json.loads(line)
    assert set(obj) == KEYS
    assert obj["level"] == "warning" and obj["logger"] == "worker.test"
    assert obj["msg"] == 'batch: 3 jobs, quote " and\nnewline'
    assert TS.match(obj["ts"]), obj["ts"]

    obj = json.loads(fmt.format(_record("x", fields={"jobs": 3, "stream": b"s", "n": None})))
    assert obj["jobs"] == 3 and obj["stream"] == "b's'" and obj["n"] is None  # default=str

    line = fmt.format(_record("failed", exc=True))
    assert "\n" not in line
    obj = json.loads(line)
    assert set(obj) == KEYS | {"exc"} and "ValueError: boom" in obj["exc"]


def test_log_json_flag_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_parser("info").parse_args(["--log-json", "info"]).log_json is True
    assert build_parser("info").parse_args(["info"]).log_json is False
    monkeypatch.setenv("SCORING_LOG_JSON", "1")
    assert build_parser("info").parse_args(["info"]).log_json is True


@pytest.mark.redis
@pytest.mark.timeout(60)
def test_worker_with_log_json_writes_only_json_lines_and_a_batch_line(
    redis_url: str,
    key_prefix: str,
    cleanup_keys: None,
    root_logging: None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker.daemon import Worker

    # in-process: leave pytest's SIGINT/SIGTERM handlers alone
    monkeypatch.setattr(Worker, "install_signal_handlers", lambda self: None)
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    enqueue(
        client,
        stream,
        "j1",
        keys.reply_stream(stream, "c"),
        [{"tokens": [1, 2, 3], "prompt_len": 1}],
    )
    rc = main(
        ["--log-json", "--log-level", "INFO", "serve", "--scorer", "noop", "--burst",
         "--redis-url", redis_url, "--queue", key_prefix, "--consumer", "lj",
         "--metrics-port", "-1", "--block-ms", "50"]
    )  # fmt: skip
    assert rc == 0
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines, "the worker logged nothing"
    objs = [json.loads(line) for line in lines]  # every line is one JSON object
    for obj in objs:
        assert set(obj) >= KEYS and TS.match(obj["ts"]), obj
        assert obj["level"] in ("debug", "info", "warning", "error", "critical")
    batches = [o for o in objs if o["msg"].startswith("batch: ")]
    assert len(batches) == 1, objs
    assert batches[0]["logger"] == "worker.daemon.jobs" and batches[0]["level"] == "info"
    assert re.match(r"batch: 1 jobs\b", batches[0]["msg"]), batches[0]
    fields = batches[0]  # structured fields for log pipelines, beside the message
    assert fields["jobs"] == 1 and fields["seqs"] >= 1 and fields["tokens"] > 0, fields
    assert fields["backend"] == "none" and fields["compute_ms"] >= 0, fields
    assert any("serving" in o["msg"] for o in objs)
    assert any("stopped" in o["msg"] for o in objs), objs
