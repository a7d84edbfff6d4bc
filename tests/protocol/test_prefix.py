"""The job's ``prefix``: a group's prompt sent once, each sequence ``prefix + tokens``."""

from __future__ import annotations

import asyncio
import threading
import uuid

import msgpack
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from tests.support.models import random_tokens, tiny_causal
from worker import protocol
from worker.aio_client import AsyncScoringClient
from worker.client import ScoringClient
from worker.client.inputs import normalize_seqs
from worker.config import RedisSettings
from worker.daemon import Worker
from worker.daemon.config import WorkerConfig
from worker.errors import BadRequest, ProtocolError
from worker.executor import ExecutorConfig, StatelessExecutor
from worker.keys import job_streams
from worker.observability.metrics import WorkerMetrics

PROMPT = list(range(3, 67))  # 64 tokens
COMPLETIONS = [[70, 71, 72], [80, 81], [90, 91, 92, 93]]


def _payload(**body: object) -> bytes:
    base = {"v": 1, "id": "j", "mode": "reference", "reply_to": "r"}
    return msgpack.packb({**base, **body}, use_bin_type=True)


def test_a_decoded_sequence_is_the_prefix_then_its_tokens_scored_after_the_prefix() -> None:
    job = protocol.decode_job(_payload(prefix=PROMPT, seqs=[{"tokens": c} for c in COMPLETIONS]))
    for spec, c in zip(job.seqs, COMPLETIONS, strict=True):
        assert list(spec.tokens) == PROMPT + c
        assert spec.prompt_len == len(PROMPT) and spec.num_scored == len(c)


def test_prompt_len_and_mask_count_over_the_whole_sequence() -> None:
    mask = [0] * len(PROMPT) + [0, 1, 1]
    job = protocol.decode_job(
        _payload(
            prefix=PROMPT,
            seqs=[
                {"tokens": [70, 71, 72], "prompt_len": 10},
                {"tokens": [70, 71, 72], "mask": mask},
            ],
        )
    )
    assert job.seqs[0].prompt_len == 10 and job.seqs[0].num_scored == len(PROMPT) + 3 - 10
    assert job.seqs[1].num_scored == 2


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"prefix": [], "seqs": [{"tokens": [1, 2]}]}, "prefix"),
        ({"prefix": [-1], "seqs": [{"tokens": [1, 2]}]}, "prefix"),
        ({"prefix": "abc", "seqs": [{"tokens": [1, 2]}]}, "prefix"),
        (
            {"prefix": [1, 2], "seqs": [{"messages": [{"role": "user", "content": "x"}]}]},
            "needs tokens",
        ),
        ({"prefix": [1, 2], "seqs": [{"tokens": [3], "prompt_len": 3}]}, "prompt_len"),
    ],
)
def test_a_bad_prefix_is_a_protocol_error(body: dict, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        protocol.decode_job(_payload(**body))


def test_the_token_limit_counts_each_whole_sequence() -> None:
    limits = protocol.Limits(max_tokens=3 * len(PROMPT))
    seqs = [{"tokens": c} for c in COMPLETIONS]
    with pytest.raises(ProtocolError, match="more than"):
        protocol.decode_job(_payload(prefix=PROMPT, seqs=seqs), limits)


def test_the_prompt_travels_once_and_decodes_to_the_same_job() -> None:
    whole = normalize_seqs([{"tokens": PROMPT + c, "prompt_len": len(PROMPT)} for c in COMPLETIONS])
    plain = protocol.encode_job("j", "reference", "r", whole)
    once = protocol.encode_job("j", "reference", "r", whole, prefix=PROMPT)
    assert len(once) < len(plain) - 4 * len(PROMPT) * (len(COMPLETIONS) - 1) + 64
    a, b = protocol.decode_job(plain), protocol.decode_job(once)
    assert [list(s.tokens) for s in a.seqs] == [list(s.tokens) for s in b.seqs]
    assert [s.prompt_len for s in a.seqs] == [s.prompt_len for s in b.seqs]
    with pytest.raises(ProtocolError, match="does not start with the job's prefix"):
        protocol.encode_job("j", "reference", "r", whole, prefix=[9, 9])


def test_the_client_refuses_an_empty_prefix_before_sending() -> None:
    with pytest.raises(BadRequest, match="prefix"):
        normalize_seqs([[1, 2]], prefix=[])


@pytest.mark.redis
def test_score_groups_equals_scoring_the_whole_sequences(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    vocab = 96
    executor = StatelessExecutor(
        ExecutorConfig(), reference_model=tiny_causal("llama", vocab=vocab)
    )
    prompt = random_tokens(40, 1, vocab=vocab)
    completions = [random_tokens(5 + i, 10 + i, vocab=vocab) for i in range(4)]
    config = WorkerConfig(
        streams=tuple(job_streams(key_prefix, 1)), consumer=f"c{uuid.uuid4().hex[:6]}",
        metrics_port=None, block_ms=50, claim_idle_ms=5000, max_wait_ms=1,
    )  # fmt: skip
    worker = Worker(
        config, RedisSettings(url=redis_url), executor, metrics=WorkerMetrics(CollectorRegistry())
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()

    async def grouped_async() -> list:
        async with AsyncScoringClient(redis_url, queue=key_prefix) as ac:
            return await ac.score_groups(prompt, completions, timeout=60)

    try:
        with ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True) as client:
            grouped = client.score_groups(prompt, completions, timeout=60)
            whole = client.score(
                [{"tokens": prompt + c, "prompt_len": len(prompt)} for c in completions],
                timeout=60,
            )
        grouped_async_scores = asyncio.run(grouped_async())
    finally:
        worker.request_stop()
        thread.join(30)
    for g, a, w, c in zip(grouped, grouped_async_scores, whole, completions, strict=True):
        assert g.logps.shape == (len(c),)
        np.testing.assert_array_equal(g.logps, w.logps)
        np.testing.assert_array_equal(a.logps, w.logps)
