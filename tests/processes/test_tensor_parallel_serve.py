"""``serve --device cpu --tensor-parallel 2`` through a real Redis: a tiny Llama reference model
(4 heads, 2 KV heads) and a tiny Llama reward model sharded over two gloo ranks answer
log-probs, entropy, top-k, gathered log-probs and rewards equal to one process within 1e-5;
what a group cannot serve is refused at start in one or two ``error:`` lines, exit 2."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import redis

from tests.support.daemon import ROOT, WorkerProc, metric, wait_until
from tests.support.models import random_tokens, tiny_causal, tiny_config, tiny_reward
from worker.client import ScoringClient
from worker.processes.local import worker_command
from worker.streams import read_heartbeats

pytestmark = [pytest.mark.redis, pytest.mark.slow]

ATOL = 1e-5
OUTPUTS = ["logps", "entropy", "topk", "gather"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("tp-models")
    tiny_causal("llama", seed=0).save_pretrained(root / "ref")
    tiny_reward("llama", seed=1).save_pretrained(root / "rew")
    return str(root / "ref"), str(root / "rew")


def _jobs() -> list[list[dict]]:
    out = []
    for i, n in enumerate((9, 23, 40, 17, 31, 6)):
        tokens = random_tokens(n, 100 + i)
        seq: dict = {"tokens": tokens, "prompt_len": 1 + i % 4}
        if i % 3 == 2:  # a mask instead of a prompt length
            seq = {"tokens": tokens, "mask": [0] + [(i + t) % 2 for t in range(n - 2)] + [1]}
        out.append([seq, {"tokens": random_tokens(5 + i, 200 + i), "prompt_len": 2}])
    return out


def _inputs(job: list[dict]) -> list:
    from worker.executor import SequenceInput

    return [SequenceInput(s["tokens"], s.get("prompt_len"), s.get("mask")) for s in job]


def test_two_ranks_answer_what_one_process_does(
    models: tuple[str, str], redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    from worker.executor import ExecutorConfig, StatelessExecutor
    from worker.scorer import ScoreOptions
    from worker.scorer.teacher import TokenOutputs

    ref, rew = models
    worker = WorkerProc(
        ["--redis-url", redis_url, "--queue", key_prefix, "--consumer", "tp", "--device", "cpu",
         "--tensor-parallel", "2", "--reference-model", ref, "--reward-model", rew,
         "--metrics-port", "0", "--block-ms", "100", "--max-wait-ms", "20"],
        tmp_path / "worker.log",
    )  # fmt: skip
    one = StatelessExecutor.from_pretrained(
        ExecutorConfig(mode="both", device="cpu"), reference_model=ref, reward_model=rew
    )
    spec = TokenOutputs(
        frozenset({"logps", "entropy", "topk", "gather"}),
        topk=5,
        gather_ids=(3, 50, 95),
        temperature=0.8,
    )
    jobs = _jobs()
    try:
        worker.wait_ready(90)
        client = ScoringClient(redis_url, queue=key_prefix, block_ms=100)
        try:
            handles = [
                client.submit(
                    job,
                    mode="both",
                    temperature=0.8,
                    outputs=OUTPUTS,
                    topk=5,
                    gather_ids=[3, 50, 95],
                )
                for job in jobs
            ]
            plain = client.submit(jobs[0], mode="reference")  # a log-probs-only job too
            results = [client.result(h, timeout=90) for h in handles]
            plain_result = client.result(plain, timeout=90)
        finally:
            client.close()
        assert results[0].info["tensor_parallel"] == 2
        for job, got in zip(jobs, results, strict=True):
            want = one.score(
                _inputs(job), mode="both", temperature=0.8, options=ScoreOptions(outputs=spec)
            ).scores
            for g, w in zip(got.seqs, want, strict=True):
                assert w.arrays is not None
                np.testing.assert_allclose(g.logps, w.logps, atol=ATOL, rtol=0)
                assert g.reward == pytest.approx(w.reward, abs=ATOL)
                np.testing.assert_allclose(g.entropy, w.arrays["entropy"], atol=ATOL, rtol=0)
                np.testing.assert_array_equal(g.topk_ids, w.arrays["topk_ids"])
                np.testing.assert_allclose(g.topk_logps, w.arrays["topk_logps"], atol=ATOL)
                np.testing.assert_allclose(
                    g.topk_tail_logp, w.arrays["topk_tail_logp"], atol=ATOL, rtol=0
                )
                np.testing.assert_allclose(g.gather_logps, w.arrays["gather_logps"], atol=ATOL)
        want_plain = one.score(_inputs(jobs[0]), mode="reference").scores
        for g, w in zip(plain_result.seqs, want_plain, strict=True):
            np.testing.assert_allclose(g.logps, w.logps, atol=ATOL, rtol=0)
        url = worker.metrics_url
        assert metric(url, "scoring_tp_ranks") == 2
        assert metric(url, "scoring_tp_rank_peak_bytes", '{rank="1"}') > 0
        assert metric(url, "scoring_tp_collective_seconds_total", '{kind="head"}') > 0
        assert "[rank 1]" in worker.log()  # the follower's lines, tagged
        beats = wait_until(
            lambda: read_heartbeats(redis.Redis.from_url(redis_url), key_prefix),
            30,
            what="a heartbeat",
        )
        assert beats[0]["tensor_parallel"] == "2"
        assert beats[0]["tensor_parallel_devices"] == ["cpu", "cpu"]
    finally:
        worker.stop()


def _serve(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        worker_command(["--device", "cpu", "--metrics-port", "-1",
                        "--redis-url", "redis://127.0.0.1:1/0", *flags]),
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip


def test_four_ranks_are_refused_at_start_naming_the_heads(models: tuple[str, str]) -> None:
    ref, rew = models
    proc = _serve("--tensor-parallel", "4", "--reference-model", ref, "--reward-model", rew)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("error: --tensor-parallel 4:"), proc.stderr
    assert "4 attention heads, 2 KV heads and a vocabulary of 96" in lines[0]
    assert "Sizes that work: 1, 2" in lines[0]
    assert len(lines) <= 2, proc.stderr  # no traceback, no rank started
    assert "rank 1" not in proc.stderr


def test_what_a_group_cannot_serve_is_refused(models: tuple[str, str], tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    from worker.cli import build_parser
    from worker.errors import ConfigError
    from worker.processes.tp_group import check_tp_group

    ref, rew = models
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(tiny_config("gpt2", bos_token_id=0, eos_token_id=0)).save_pretrained(gpt2)
    from worker.demo.tiny import tiny_vlm

    vlm = tmp_path / "vlm"
    tiny_vlm("qwen2_vl", seed=0)[0].save_pretrained(vlm)
    cases = {
        "no tensor-parallel plan": ("--reference-model", str(gpt2)),
        "vision-language model; images are not served": ("--reference-model", str(vlm)),
        "per-job adapters": ("--reference-model", ref, "--adapter-root", str(tmp_path)),
        "--scorer noop has none": ("--scorer", "noop"),
        "--reward-adapter runs code": ("--reward-model", rew, "--reward-adapter", "x:y"),
        "LM-label process reward": ("--reward-model", ref, "--reward-head", "lm-label"),
        "GGUF": ("--reference-model", ref, "--gguf-file", "m.gguf"),
    }
    parser = build_parser("serve")
    with pytest.raises(ConfigError, match="must be >= 1, got 0"):
        check_tp_group(parser.parse_args(["serve", "--tensor-parallel", "0"]))
    for words, flags in cases.items():
        argv = ["serve", "--device", "cpu", "--tensor-parallel", "2", *flags]
        with pytest.raises(ConfigError) as err:
            check_tp_group(parser.parse_args(argv))
        assert words in str(err.value), (words, str(err.value))
