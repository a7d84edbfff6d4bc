"""A job is validated and planned once, at intake, and the batch runs that plan.

The executor's planning steps are counted while a real worker (in this process, over the
machine's Redis) serves jobs through the client: each sequence is checked once and each job's
calls are decided once, whatever batches the daemon makes of them, and the scores equal the
executor's own.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from tests.support.models import random_tokens, tiny_causal
from worker.client import ScoringClient
from worker.config import RedisSettings
from worker.daemon import Worker
from worker.daemon.config import WorkerConfig
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.executor import call as call_module
from worker.executor import core as core_module
from worker.keys import job_streams
from worker.observability.metrics import WorkerMetrics

pytestmark = pytest.mark.redis

VOCAB = 64


def _counting(counts: Counter[str], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[name] += 1
        return fn(*args, **kwargs)

    return counted


def test_each_sequence_is_checked_once_and_each_job_planned_once(
    redis_url: str, key_prefix: str, cleanup_keys: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    executor = StatelessExecutor(
        ExecutorConfig(max_batch_tokens=64), reference_model=tiny_causal("llama", vocab=VOCAB)
    )
    jobs = [
        [{"tokens": random_tokens(6 + 3 * j + i, 10 * j + i, vocab=VOCAB), "prompt_len": 2}
         for i in range(1 + j % 3)]
        for j in range(9)
    ]  # fmt: skip
    want = [
        executor.score([SequenceInput(s["tokens"], prompt_len=2) for s in seqs]).scores
        for seqs in jobs
    ]
    counts: Counter[str] = Counter()
    monkeypatch.setattr(
        core_module, "plan_calls", _counting(counts, "plan", core_module.plan_calls)
    )
    monkeypatch.setattr(
        call_module, "prepare_sequence", _counting(counts, "check", call_module.prepare_sequence)
    )
    config = WorkerConfig(
        streams=tuple(job_streams(key_prefix, 1)), consumer=f"c{uuid.uuid4().hex[:6]}",
        metrics_port=None, block_ms=50, claim_idle_ms=5000, max_wait_ms=50,
    )  # fmt: skip
    worker = Worker(
        config, RedisSettings(url=redis_url), executor, metrics=WorkerMetrics(CollectorRegistry())
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        with ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True) as client:
            handles = [client.submit(seqs) for seqs in jobs]
            got = [client.result(h, timeout=60).seqs for h in handles]
    finally:
        worker.request_stop()
        thread.join(30)
    n_seqs = sum(len(seqs) for seqs in jobs)
    assert counts["plan"] == len(jobs), counts  # one plan per job, at intake
    assert counts["check"] == n_seqs, counts  # each sequence checked once
    assert worker.jobs_done == len(jobs)
    for scores, ref in zip(got, want, strict=True):
        for s, r in zip(scores, ref, strict=True):
            np.testing.assert_allclose(s.logps, r.logps, atol=1e-5)
