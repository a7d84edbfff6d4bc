"""Group scoring through a real worker and the machine's Redis, on every attention variant.

For each architecture two workers serve the same models, one with ``prefix_sharing="auto"`` and
one with ``"off"`` (every sequence alone); the same jobs go to both and every output must agree
within 2e-5 (float32): a GRPO group sent with its prompt once (the ``prefix`` key) asking for
teacher outputs (log-probs at a temperature, entropy, top-k with its tail, gather at ids,
processed log-probs), agent rollouts sharing three levels of turns with masks in ``mode="both"``
(log-probs and a reward model's rewards), and a reward job. The sharing worker reports the tokens
it computed once (``info["shared_tokens"]``, the metrics); Qwen3-Next (linear attention) is served
per sequence with its reason. LoRA adapters: a group scored under an adapter shares too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.daemon import thread_worker
from tests.support.models import VOCAB, tiny_reward, tiny_variant
from worker.client import ScoringClient
from worker.executor import ExecutorConfig, StatelessExecutor

pytestmark = pytest.mark.redis

ATOL = 2e-5
SYSTEM, TURN, REPLY = 40, 36, 34
TEACHER: dict[str, Any] = {
    "outputs": ["logps", "entropy", "topk", "gather", "processed_logps"],
    "topk": 5,
    "gather_ids": [1, 7, 3],
    "sampling": {"top_k": 7, "top_p": 0.9},
}


def _toks(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB, n).tolist()


def _jobs(seed: int) -> dict[str, dict[str, Any]]:
    """The jobs both workers score (name -> ``submit`` keywords)."""
    rng = np.random.default_rng(seed)
    prompt = _toks(rng, 48)
    grpo = [{"tokens": _toks(rng, 3 + 2 * i)} for i in range(6)]
    system = _toks(rng, SYSTEM)
    agent = []
    for _ in range(2):
        turn = _toks(rng, TURN)
        for _ in range(2):
            reply = _toks(rng, REPLY)
            for _ in range(2):
                tokens = system + turn + reply + _toks(rng, int(rng.integers(2, 9)))
                agent.append(
                    {"tokens": tokens, "mask": [int(i % 3 > 0) for i in range(len(tokens))]}
                )
    agent.append({"tokens": _toks(rng, 19), "prompt_len": 4})  # shares nothing
    return {
        "grpo": {
            "seqs": grpo,
            "prefix": prompt,
            "temperature": 0.8,
            "mode": "reference",
            **TEACHER,
        },
        "agent": {"seqs": agent, "mode": "both", "temperature": 0.9},
        "reward": {
            "seqs": [{"tokens": s["tokens"], "prompt_len": 4} for s in agent],
            "mode": "reward",
        },
    }


def _serve(
    redis_url: str, queue: str, executor: StatelessExecutor, jobs: dict[str, dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, float]]:
    """``jobs`` through a worker for ``executor``: the results by name, and its token counters."""
    with (
        thread_worker(redis_url, queue, executor) as (_, registry),
        ScoringClient(redis_url, queue=queue, wait_for_unknown_queue=True) as client,
    ):
        handles = {name: client.submit(**kw) for name, kw in jobs.items()}
        results = {name: client.result(h, timeout=120) for name, h in handles.items()}
    counters = {
        name: registry.get_sample_value(f"scoring_{name}_total") or 0.0
        for name in ("forward_tokens", "shared_prefix_tokens", "tokens")
    }
    return results, counters


ARRAYS = (
    "logps", "token_scores", "rewards", "step_scores", "entropy", "topk_logps", "topk_tail_logp",
    "gather_logps", "processed_logps",
)  # fmt: skip


def _same(a: Any, b: Any) -> None:
    """Every output of two results agrees (floats within ``ATOL``, ids exactly)."""
    for x, y in zip(a.seqs, b.seqs, strict=True):
        for name in ARRAYS:
            u, v = getattr(x, name), getattr(y, name)
            assert (u is None) == (v is None), name
            if u is not None:
                np.testing.assert_allclose(u, v, atol=ATOL, rtol=0, err_msg=name)
        for name in ("topk_ids", "step_positions", "rm_tokens"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=name)
        assert (x.reward is None) == (y.reward is None)
        if x.reward is not None:
            assert abs(x.reward - y.reward) <= ATOL


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "mistral", "gpt_oss"])
def test_trees_through_redis_give_the_per_sequence_results(
    arch: str, redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    backend = "eager" if arch in ("gemma2", "gpt_oss") else "sdpa"
    model, reward = tiny_variant(arch), tiny_reward("llama").float().eval()
    jobs = _jobs(seed=len(arch))
    out: dict[str, Any] = {}
    for sharing in ("auto", "off"):
        config = ExecutorConfig(mode="both", prefix_sharing=sharing, attention_backend=backend)
        executor = StatelessExecutor(config, model, reward)
        assert executor.info["prefix_sharing"] == (
            "on" if sharing == "auto" else "off: disabled (prefix_sharing=off)"
        )
        out[sharing] = _serve(redis_url, f"{key_prefix}{sharing}", executor, jobs)
    (on, on_counts), (off, off_counts) = out["auto"], out["off"]
    for name in jobs:
        _same(on[name], off[name])
    grpo, agent = on["grpo"].seqs[0], on["agent"].seqs[0]
    assert grpo.entropy is not None and grpo.topk_ids is not None and grpo.gather_logps is not None
    assert agent.logps is not None and agent.reward is not None
    shared = SYSTEM + TURN + REPLY
    assert on["grpo"].info["shared_tokens"] == 48 * 6
    assert on["agent"].info["shared_tokens"] == shared * 8  # every level, each member
    assert on["reward"].info["shared_tokens"] == shared * 8
    assert all(off[name].info["shared_tokens"] == 0 for name in jobs)
    assert on_counts["tokens"] == off_counts["tokens"]
    assert on_counts["forward_tokens"] < off_counts["forward_tokens"] == off_counts["tokens"]
    assert on_counts["shared_prefix_tokens"] > 0 and off_counts["shared_prefix_tokens"] == 0


def test_linear_attention_is_served_per_sequence_with_its_reason(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    executor = StatelessExecutor(
        ExecutorConfig(attention_backend="eager"), tiny_variant("qwen3_next")
    )
    assert (
        executor.info["prefix_sharing"].startswith("off: ")
        and "linear" in executor.info["prefix_sharing"]
    )
    jobs = {"grpo": _jobs(seed=3)["grpo"]}
    results, counters = _serve(redis_url, key_prefix, executor, jobs)
    assert results["grpo"].seqs[0].entropy is not None
    assert results["grpo"].info["shared_tokens"] == 0
    assert counters["shared_prefix_tokens"] == 0


def test_a_group_under_a_lora_adapter_shares_its_prompt(
    redis_url: str, key_prefix: str, cleanup_keys: None, tmp_path: Path
) -> None:
    from tests.support.adapters import write_fleet
    from worker.executor.weights.residency import WeightsConfig

    fleet = write_fleet(tmp_path)
    jobs = {
        name: {**_jobs(seed=5)["grpo"], "adapter": adapter}
        for name, adapter in (("base", None), ("lora", "run42/step-120"))
    }
    out = {}
    for sharing in ("auto", "off"):
        weights = WeightsConfig(
            adapter_root=str(fleet["adapters"]), model_root=str(fleet["models"])
        )
        executor = StatelessExecutor.from_pretrained(
            ExecutorConfig(prefix_sharing=sharing), str(fleet["base"]), weights=weights
        )
        out[sharing], _ = _serve(redis_url, f"{key_prefix}{sharing}", executor, jobs)
    for name in jobs:
        _same(out["auto"][name], out["off"][name])
        assert out["auto"][name].info["shared_tokens"] == 48 * 6
    assert not np.allclose(out["auto"]["base"].seqs[0].logps, out["auto"]["lora"].seqs[0].logps)
