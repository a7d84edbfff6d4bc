"""serve flags, their SCORING_* env equivalents, and WorkerConfig validation (no Redis)."""

from __future__ import annotations

import argparse

import pytest

from worker.commands import serve
from worker.daemon.config import WorkerConfig
from worker.errors import ConfigError
from worker.protocol import DEFAULT_LIMITS, Limits


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.configure(parser)
    return parser.parse_args(argv)


def test_env_equivalents_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCORING_MAX_BATCH_TOKENS", "777")
    monkeypatch.setenv("SCORING_CLAIM_IDLE_MS", "4000")
    monkeypatch.setenv("SCORING_QUEUE", "ref-7b")
    monkeypatch.setenv("SCORING_BURST", "true")
    monkeypatch.setenv("POD_NAME", "pod-3")
    cfg = serve.worker_config(_parse(["--claim-idle-ms", "9000"]))
    assert cfg.max_batch_tokens == 777 and cfg.claim_idle_ms == 9000 and cfg.burst
    assert cfg.streams == ("scoring:{ref-7b}:jobs",)
    assert cfg.consumer == "pod-3"


def test_streams_from_queue_partitions_or_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SCORING_STREAM", raising=False)
    cfg = serve.worker_config(_parse(["--queue", "q", "--partitions", "3"]))
    assert cfg.streams == ("scoring:{q:0}:jobs", "scoring:{q:1}:jobs", "scoring:{q:2}:jobs")
    cfg = serve.worker_config(_parse(["--stream", "a:{x}:jobs, b:{y}:jobs"]))
    assert cfg.streams == ("a:{x}:jobs", "b:{y}:jobs")
    assert serve.worker_config(_parse(["--metrics-port", "-1"])).metrics_port is None
    limits = serve.worker_config(_parse(["--max-seqs-per-job", "3"])).limits
    assert limits.max_seqs == 3


def test_limit_flags_env_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MAX_PAYLOAD_BYTES", "MAX_SEQS_PER_JOB", "MAX_TOKENS_PER_JOB", "MAX_META_BYTES"):
        monkeypatch.delenv(f"SCORING_{name}", raising=False)
    assert serve.worker_config(_parse([])).limits == DEFAULT_LIMITS
    monkeypatch.setenv("SCORING_MAX_PAYLOAD_BYTES", "1048576")
    monkeypatch.setenv("SCORING_MAX_META_BYTES", "1024")
    monkeypatch.setenv("SCORING_MAX_TOKENS_PER_JOB", "5000")
    limits = serve.worker_config(_parse(["--max-seqs-per-job", "7"])).limits
    assert limits == Limits(
        max_payload_bytes=1048576, max_seqs=7, max_tokens=5000, max_meta_bytes=1024
    )
    limits = serve.worker_config(_parse(["--max-payload-bytes", "4096"])).limits
    assert limits.max_payload_bytes == 4096  # the flag wins over the environment


@pytest.mark.parametrize(
    "flag",
    ["--max-payload-bytes", "--max-seqs-per-job", "--max-tokens-per-job", "--max-meta-bytes"],
)
def test_limit_flags_must_be_positive(flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        serve.worker_config(_parse([flag, "0"]))


def test_executor_scorer_needs_a_model() -> None:
    with pytest.raises(ConfigError, match="reference-model"):
        serve.build_scorer(_parse(["--scorer", "executor"]))
    noop = serve.build_scorer(_parse(["--scorer", "noop", "--noop-delay-ms", "7"]))
    assert noop.delay_ms == 7 and noop.modes == ("reference", "reward", "both")


@pytest.mark.parametrize(
    "bad",
    [
        {"streams": ()},
        {"max_batch_tokens": 0},
        {"claim_idle_ms": 0},
        {"max_deliveries": 0},
        {"drain_timeout_s": 0},
        {"max_jobs": 0},
        {"consumer": ""},
    ],
)
def test_worker_config_rejects_bad_values(bad: dict) -> None:
    kwargs = {"streams": ("s",), **bad}
    with pytest.raises(ConfigError):
        WorkerConfig(**kwargs)


def test_lease_interval_is_a_third_of_claim_idle() -> None:
    cfg = WorkerConfig(streams=("s",), claim_idle_ms=3000)
    assert cfg.lease_interval_s == pytest.approx(1.0)
    assert cfg.reclaim_every_s == pytest.approx(1.5)


def test_isolation_and_consumer_cleanup_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = serve.worker_config(_parse(["--stream", "scoring:{q}:jobs"]))
    assert cfg.isolate_after_deliveries == 2 and cfg.forget_consumer
    monkeypatch.setenv("SCORING_ISOLATE_AFTER_DELIVERIES", "3")
    monkeypatch.setenv("SCORING_KEEP_CONSUMER", "1")
    cfg = serve.worker_config(_parse(["--stream", "scoring:{q}:jobs"]))
    assert cfg.isolate_after_deliveries == 3 and not cfg.forget_consumer
    with pytest.raises(ConfigError, match="isolate_after_deliveries"):
        WorkerConfig(streams=("s",), isolate_after_deliveries=0)
