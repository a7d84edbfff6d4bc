"""The happy path end to end: real Redis/Valkey, a real `python -m worker serve` subprocess,
results compared with the in-process executor on the same tiny models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import redis

from tests.support.daemon import WorkerProc, collect, enqueue, metric, wait_until
from worker import keys

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A tiny Llama and a tiny Llama reward model (num_labels=1) saved to directories."""
    from tests.support.models import tiny_causal, tiny_reward

    root = tmp_path_factory.mktemp("models")
    ref, rew = root / "ref", root / "rew"
    tiny_causal("llama", seed=0).save_pretrained(ref)
    tiny_reward("llama", seed=1).save_pretrained(rew)
    return str(ref), str(rew)


def _jobs() -> list[tuple[str, str, list[dict], float]]:
    """(id, mode, seqs, temperature): every mode, prompt_len and mask, ragged lengths."""
    from tests.support.models import random_tokens

    out = []
    for i in range(9):
        mode = ("reference", "reward", "both")[i % 3]
        seqs = []
        for k in range(1 + i % 3):
            toks = random_tokens(5 + 7 * k + i, seed=100 * i + k)
            if k % 2:
                mask = [0] * 3 + [1] * (len(toks) - 3)
                mask[len(toks) // 2] = 0
                seqs.append({"tokens": toks, "mask": mask})
            else:
                seqs.append({"tokens": toks, "prompt_len": 2 + k})
        out.append((f"job-{i}", mode, seqs, 0.7 if i == 4 else 1.0))
    return out


@pytest.mark.timeout(180)
def test_every_mode_matches_in_process_executor(
    any_redis_url: str, model_dirs: tuple[str, str], key_prefix: str, tmp_path: Path
) -> None:
    from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor

    ref, rew = model_dirs
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c1")
    client = redis.Redis.from_url(any_redis_url)
    jobs = _jobs()
    for job_id, mode, seqs, temp in jobs:  # queued before the worker starts: batches form
        enqueue(
            client, stream, job_id, reply, seqs, mode=mode, temperature=temp, meta={"job": job_id}
        )
    worker = WorkerProc(
        ["--redis-url", any_redis_url, "--queue", key_prefix, "--consumer", "w1",
         "--reference-model", ref, "--reward-model", rew, "--device", "cpu",
         "--metrics-port", "0", "--max-wait-ms", "20"],
        tmp_path / "worker.log",
    )  # fmt: skip
    try:
        worker.wait_ready()
        results, dups = collect(client, reply, [j[0] for j in jobs], timeout=60)
        executor = StatelessExecutor.from_pretrained(
            ExecutorConfig(mode="both", device="cpu"), reference_model=ref, reward_model=rew
        )
        for job_id, mode, seqs, temp in jobs:
            res = results[job_id]
            assert res.ok, res.error
            assert res.meta == {"job": job_id}
            assert res.info["worker"] == "w1"
            assert res.info["temperature"] == temp
            assert res.info["attention_backend"] in ("sdpa", "eager")
            assert res.info["model"] == ref and res.info["dtype"] == "float32"
            assert res.info["queue_ms"] >= 0 and res.info["compute_ms"] > 0
            inputs = [SequenceInput(s["tokens"], s.get("prompt_len"), s.get("mask")) for s in seqs]
            want = executor.score(inputs, mode=mode, temperature=temp).scores
            assert len(res.seqs) == len(seqs)
            for got, exp in zip(res.seqs, want, strict=True):
                if mode in ("reference", "both"):
                    np.testing.assert_allclose(np.asarray(got.logps), exp.logps, atol=1e-4)
                else:
                    assert got.logps is None
                if mode in ("reward", "both"):
                    assert got.reward == pytest.approx(exp.reward, abs=1e-4)
                else:
                    assert got.reward is None
        assert dups == 0
        url = worker.metrics_url
        assert metric(url, "scoring_jobs_total", '{outcome="ok"}') == len(jobs)
        wait_until(lambda: client.xpending(stream, "scoring")["pending"] == 0, 10, what="acks")
    finally:
        worker.stop()
        for key in (stream, reply, keys.dead_letter_stream(stream)):
            client.delete(key)


@pytest.mark.timeout(120)
def test_many_jobs_across_two_workers(redis_url: str, key_prefix: str, tmp_path: Path) -> None:
    """Two noop workers on one group share 300 jobs; each job gets exactly one result."""
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c1")
    client = redis.Redis.from_url(redis_url)
    common = ["--redis-url", redis_url, "--queue", key_prefix, "--scorer", "noop",
              "--metrics-port", "-1", "--noop-delay-ms", "5",
              "--max-batch-tokens", "64"]  # fmt: skip
    workers = [WorkerProc([*common, "--consumer", f"w{i}"], tmp_path / f"w{i}.log") for i in (1, 2)]
    try:
        for w in workers:
            w.wait_ready()
        ids = [f"j{i}" for i in range(300)]
        for i, job_id in enumerate(ids):
            enqueue(
                client, stream, job_id, reply, [{"tokens": [1, 2, 3, i % 50 + 1], "prompt_len": 1}]
            )
        results, dups = collect(client, reply, ids, timeout=60)
        assert dups == 0
        by_worker = {r.info["worker"] for r in results.values()}
        assert by_worker == {"w1", "w2"}
        # noop logps are a function of the tokens: check they were not mixed up between jobs
        for i, job_id in enumerate(ids):
            tok = i % 50 + 1
            expect = [-np.log(32000) - (t % 7) / 100 for t in (2, 3, tok)]
            np.testing.assert_allclose(np.asarray(results[job_id].seqs[0].logps), expect, atol=1e-5)
        wait_until(lambda: client.xpending(stream, "scoring")["pending"] == 0, 10, what="acks")
    finally:
        for w in workers:
            w.stop()
        for key in (stream, reply):
            client.delete(key)
