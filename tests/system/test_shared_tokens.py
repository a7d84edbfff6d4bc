"""A job's ``info["shared_tokens"]`` through a real worker (in this process, over the machine's
Redis) and the client: the tokens of its sequences computed once for several, the sum over its
sequences of the shared prefix each was scored under.

A GRPO group of G completions of a P-token prompt, sent as whole sequences or with the prompt as
the job's ``prefix``, reports P x G with prefix sharing on; a job of unrelated sequences, and the
same group with sharing off, report 0.
"""

from __future__ import annotations

from typing import Any, Literal

import pytest
from prometheus_client import CollectorRegistry

from tests.support.daemon import thread_worker
from tests.support.models import random_tokens, tiny_causal
from worker.client import ScoringClient
from worker.executor import ExecutorConfig, StatelessExecutor

pytestmark = pytest.mark.redis

VOCAB = 64
MIN_SHARED = 16


def _completions(g: int, seed: int) -> list[list[int]]:
    """``g`` completions whose first ids differ (the group shares the prompt, nothing more)."""
    return [[1 + i, *random_tokens(3 + 2 * i, seed + i, vocab=VOCAB)] for i in range(g)]


def _serve(
    redis_url: str, queue: str, sharing: Literal["auto", "off"], jobs: dict[str, dict[str, Any]]
) -> tuple[dict[str, dict[str, Any]], CollectorRegistry]:
    """Submit ``jobs`` (name -> ``submit`` keywords) to a worker with ``prefix_sharing`` set to
    ``sharing``: each job's result ``info`` and the worker's metrics."""
    executor = StatelessExecutor(
        ExecutorConfig(prefix_sharing=sharing, min_shared_tokens=MIN_SHARED),
        reference_model=tiny_causal("llama", vocab=VOCAB),
    )
    want = "on" if sharing == "auto" else "off:"
    assert executor.info["prefix_sharing"].startswith(want), executor.info["prefix_sharing"]
    with (
        thread_worker(redis_url, queue, executor) as (_, registry),
        ScoringClient(redis_url, queue=queue, wait_for_unknown_queue=True) as client,
    ):
        handles = {name: client.submit(**kw) for name, kw in jobs.items()}
        infos = {name: client.result(h, timeout=60).info for name, h in handles.items()}
    return infos, registry


def test_a_group_reports_its_prompt_times_its_members_and_unshared_jobs_zero(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    prompt = random_tokens(40, 1, vocab=VOCAB)
    group = _completions(4, 10)
    prefixed_prompt = random_tokens(24, 2, vocab=VOCAB)
    prefixed = _completions(3, 20)
    jobs: dict[str, dict[str, Any]] = {
        "group": {"seqs": [{"tokens": prompt + c, "prompt_len": len(prompt)} for c in group]},
        "prefix": {"seqs": [{"tokens": c} for c in prefixed], "prefix": prefixed_prompt},
        "alone": {
            "seqs": [
                {"tokens": random_tokens(30 + i, 30 + i, vocab=VOCAB), "prompt_len": 2}
                for i in range(3)
            ]
        },
    }
    on, registry = _serve(redis_url, f"{key_prefix}on", "auto", jobs)
    assert on["group"]["shared_tokens"] == len(prompt) * len(group)
    assert on["prefix"]["shared_tokens"] == len(prefixed_prompt) * len(prefixed)
    assert on["alone"]["shared_tokens"] == 0
    # the worker's counter counts each shared prefix once (one tree row per group)
    shared = registry.get_sample_value("scoring_shared_prefix_tokens_total")
    assert shared == len(prompt) + len(prefixed_prompt)

    off, _ = _serve(redis_url, f"{key_prefix}off", "off", jobs)
    assert {name: info["shared_tokens"] for name, info in off.items()} == dict.fromkeys(jobs, 0)
