"""Teacher outputs and process-reward steps through batch submission: ``score_many`` (sync and
async, ``JobSpec`` and job maps, call-wide defaults) and ``scoring-worker enqueue`` (flags,
per-line ``gather_ids``/``step``, arrays as lists in the JSONL output), against a real worker on
the real Redis: the no-op scorer for shapes, a tiny model for values."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from tests.support.models import random_tokens, tiny_causal
from worker import keys
from worker.cli import main
from worker.client import JobFailed, JobSpec, ScoringClient
from worker.client.aio import AsyncScoringClient
from worker.config import RedisSettings
from worker.daemon import Worker
from worker.daemon.config import WorkerConfig
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.observability.metrics import WorkerMetrics
from worker.scorer import ScoreOptions
from worker.scorer.noop import NoopScorer
from worker.scorer.teacher import TokenOutputs

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("cleanup_keys")]

VOCAB = 1000
BASE = -math.log(VOCAB)  # what the no-op scorer answers for every teacher log-prob


def _worker(url: str, queue: str, scorer: Any) -> tuple[Worker, threading.Thread]:
    config = WorkerConfig(
        streams=(keys.job_streams(queue)[0],),
        consumer=f"c{uuid.uuid4().hex[:6]}",
        metrics_port=None,
        block_ms=50,
        claim_idle_ms=5000,
        max_wait_ms=1,
    )
    worker = Worker(
        config, RedisSettings(url=url), scorer, metrics=WorkerMetrics(CollectorRegistry())
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return worker, thread


def _stop(worker: Worker, thread: threading.Thread) -> None:
    worker.request_stop()
    thread.join(30)


@pytest.mark.timeout(90)
def test_score_many_takes_teacher_outputs_and_step_per_job_or_for_every_job(
    redis_url: str, key_prefix: str
) -> None:
    worker, thread = _worker(redis_url, key_prefix, NoopScorer(vocab_size=VOCAB))
    seq = {"tokens": [1, 2, 3, 4, 5], "prompt_len": 2}  # 3 scored positions
    per_pos = {"tokens": [5, 6, 7], "mask": [0, 1, 1], "gather_ids": [[1, 2], [3, 4]]}
    jobs: list[Any] = [
        [seq],  # takes every default: entropy + top-4, float16
        JobSpec([seq], outputs=("gather",), gather_ids=[7, 8, 9], job_id="own"),  # its own set
        {"seqs": [per_pos], "outputs": ["logps", "gather"], "id": "per-pos"},
        JobSpec(
            [{"tokens": [3, 9, 3, 3], "prompt_len": 1}],
            mode="reward",
            job_id="steps",
            step={"tag_id": 3},
        ),
        JobSpec([seq], outputs=("topk",), topk=VOCAB + 1, job_id="bad"),  # k out of range
    ]
    try:
        with ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True) as client:
            got = list(
                client.score_many(
                    jobs,
                    outputs=("logps", "entropy", "topk"),
                    topk=4,
                    float16=True,
                    timeout=30,
                    raise_errors=False,
                )
            )

        async def run() -> list[Any]:
            async with AsyncScoringClient(
                redis_url, queue=key_prefix, wait_for_unknown_queue=True
            ) as ac:
                return [
                    r
                    async for r in ac.score_many(
                        [[seq], JobSpec([{"tokens": [3, 9, 3], "prompt_len": 1}], mode="reward")],
                        outputs=("entropy",),
                        step={"tag_id": 3},
                        timeout=30,
                    )
                ]

        async_got = asyncio.run(run())
    finally:
        _stop(worker, thread)
    first, own, per, steps, bad = got
    s = first[0]
    assert s.logps.shape == (3,) and s.entropy.shape == (3,)
    assert s.topk_ids.shape == (3, 4) and s.topk_logps.dtype == np.float16
    np.testing.assert_array_equal(s.topk_ids, np.tile(np.arange(4), (3, 1)))
    assert s.gather_logps is None
    o = own[0]  # a job with settings of its own takes none of the call's
    assert o.logps is None and o.entropy is None and o.topk_ids is None
    assert o.gather_logps.shape == (3, 3) and o.gather_logps.dtype == np.float32
    np.testing.assert_allclose(o.gather_logps, BASE, rtol=1e-6)
    assert per[0].gather_logps.shape == (2, 2) and per[0].logps.shape == (2,)
    np.testing.assert_array_equal(steps[0].step_positions, [0, 2, 3])  # tag 3 at 0, 2, 3
    np.testing.assert_allclose(steps[0].step_scores, [0.3, 0.3, 0.3], rtol=1e-6)
    assert isinstance(bad, JobFailed) and bad.code == "bad_request" and "topk" in bad.reason
    assert async_got[0][0].entropy.shape == (3,)
    assert async_got[0][0].logps is None  # outputs=("entropy",) alone
    np.testing.assert_array_equal(async_got[1][0].step_positions, [0, 2])


def _run_enqueue(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    # the in-process worker may not have written its first heartbeat yet: wait for it
    rc = main(["enqueue", "--no-progress", "--wait-for-workers", "30", *args])
    return rc, capsys.readouterr().err


@pytest.mark.timeout(120)
def test_enqueue_flags_and_per_line_keys_put_every_array_in_the_jsonl(
    redis_url: str, key_prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    worker, thread = _worker(redis_url, key_prefix, NoopScorer(vocab_size=VOCAB))
    common = ["--redis-url", redis_url, "--queue", key_prefix]
    src = tmp_path / "in.jsonl"
    lines = [
        {"id": "a", "tokens": [1, 2, 3, 4, 5], "prompt_len": 2},
        {"id": "m", "seqs": [{"tokens": [1, 2, 3], "prompt_len": 1}] * 2},
    ]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    per = tmp_path / "per.jsonl"
    per_lines = [
        {
            "id": "p",
            "tokens": [1, 2, 3, 4],
            "prompt_len": 1,
            "gather_ids": [[1, 2], [3, 4], [5, 6]],
        },
        {"id": "short", "tokens": [1, 2, 3, 4], "prompt_len": 1, "gather_ids": [[1, 2]]},
    ]
    per.write_text("".join(json.dumps(x) + "\n" for x in per_lines))
    steps = tmp_path / "steps.jsonl"
    step_lines = [
        {"id": "flag", "tokens": [4, 9, 4], "prompt_len": 1},  # --step: tag 4
        {"id": "own", "tokens": [4, 9, 4], "prompt_len": 1, "step": {"tag_id": 9}},
        {"id": "badstep", "tokens": [4, 9], "prompt_len": 1, "step": {"tag_id": -1}},
    ]
    steps.write_text("".join(json.dumps(x) + "\n" for x in step_lines))
    try:
        out = tmp_path / "out.jsonl"
        rc, err = _run_enqueue(
            [*common, "--file", str(src), "--out", str(out), "--outputs",
             "logps,entropy,topk,gather", "--topk", "3", "--gather-ids", "7,8", "--float16"],
            capsys,
        )  # fmt: skip
        assert rc == 0, err
        got = {d["id"]: d for d in map(json.loads, out.read_text().splitlines())}
        a = got["a"]
        assert len(a["logps"]) == 3 and a["entropy"] == pytest.approx([-BASE] * 3, rel=1e-6)
        assert a["topk_ids"] == [[0, 1, 2]] * 3
        assert np.allclose(a["topk_logps"], BASE, rtol=1e-3)  # float16 on the wire
        assert len(a["topk_tail_logp"]) == 3
        assert np.asarray(a["gather_logps"]).shape == (3, 2)
        assert [np.asarray(s["topk_ids"]).shape for s in got["m"]["seqs"]] == [(2, 3)] * 2

        out2 = tmp_path / "out2.jsonl"
        rc, err = _run_enqueue(
            [*common, "--file", str(per), "--out", str(out2), "--outputs", "gather"], capsys
        )
        assert rc == 1  # the short line's ids do not match its scored positions
        got = {d["id"]: d for d in map(json.loads, out2.read_text().splitlines())}
        assert np.asarray(got["p"]["gather_logps"]).shape == (3, 2) and "logps" not in got["p"]
        assert "p" in got and "short" not in got  # refused at reading: never sent
        assert "skipped line 2: id short" in err and "n_scored x K" in err

        out3 = tmp_path / "out3.jsonl"
        rc, err = _run_enqueue(
            [*common, "--file", str(steps), "--out", str(out3), "--mode", "reward",
             "--step", '{"tag_id": 4}'], capsys,
        )  # fmt: skip
        assert rc == 1 and "skipped line 3: id badstep" in err and "step.tag_id" in err
        got = {d["id"]: d for d in map(json.loads, out3.read_text().splitlines())}
        assert got["flag"]["step_positions"] == [0, 2] and "reward" not in got["flag"]
        assert got["flag"]["step_scores"] == pytest.approx([0.4, 0.4])
        assert got["own"]["step_positions"] == [1] and got["own"]["step_scores"] == [
            pytest.approx(0.9)
        ]
        assert set(got) == {"flag", "own"}
        with pytest.raises(SystemExit):  # a bad --step is a usage error before anything is sent
            main(["enqueue", *common, "--file", str(steps), "--out", str(out3), "--step", "{"])
    finally:
        _stop(worker, thread)


@pytest.mark.timeout(180)
def test_enqueue_teacher_values_equal_the_executors_own(
    redis_url: str, key_prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    executor = StatelessExecutor(ExecutorConfig(), tiny_causal("llama"))
    t1, t2 = random_tokens(12, 1), random_tokens(9, 2)
    src = tmp_path / "in.jsonl"
    per_pos = (np.arange(8 * 2).reshape(8, 2) % 96).tolist()
    src.write_text(
        json.dumps({"id": "x", "tokens": t1, "prompt_len": 4, "gather_ids": per_pos}) + "\n"
        + json.dumps({"id": "y", "tokens": t2, "mask": [0, 0, 1, 1, 0, 1, 1, 1, 0],
                      "gather_ids": [[5, 6]] * 5}) + "\n"
    )  # fmt: skip
    worker, thread = _worker(redis_url, key_prefix, executor)
    try:
        out = tmp_path / "out.jsonl"
        rc, err = _run_enqueue(
            ["--redis-url", redis_url, "--queue", key_prefix, "--file", str(src), "--out",
             str(out), "--outputs", "logps,entropy,topk,gather", "--topk", "5",
             "--temperature", "0.7"], capsys,
        )  # fmt: skip
    finally:
        _stop(worker, thread)
    assert rc == 0, err
    got = {d["id"]: d for d in map(json.loads, out.read_text().splitlines())}
    spec = TokenOutputs(frozenset({"logps", "entropy", "topk", "gather"}), topk=5, gather_width=2)
    seqs = [
        SequenceInput(t1, prompt_len=4, gather_ids=np.asarray(per_pos, np.int32)),
        SequenceInput(
            t2, mask=[0, 0, 1, 1, 0, 1, 1, 1, 0], gather_ids=np.full((5, 2), [5, 6], np.int32)
        ),
    ]
    direct = executor.score(seqs, temperature=0.7, options=ScoreOptions(outputs=spec)).scores
    executor.close()
    for name, score in zip(("x", "y"), direct, strict=True):
        line = got[name]
        np.testing.assert_allclose(line["logps"], score.logps, atol=1e-6)
        for key, value in (score.arrays or {}).items():
            np.testing.assert_allclose(np.asarray(line[key]), value, atol=1e-6, err_msg=key)
        assert set(score.arrays or {}) == {
            "entropy",
            "topk_ids",
            "topk_logps",
            "topk_tail_logp",
            "gather_logps",
        }
