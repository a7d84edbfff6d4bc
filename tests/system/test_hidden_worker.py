"""``hidden`` rows through a real worker (this process, the machine's Redis) and the client:
multiplied by the head read back from the served checkpoint with the transforms the result's
``info["head"]`` names (docs/examples/hidden_logps.py), they give the worker's ``logps`` (1e-5 in
float32, bfloat16's own bound in bfloat16) on Llama, Gemma 2 (softcap), Cohere (logit scale),
Phi (head bias) and GPT-2 (tied head), packed and in prefix trees, and under a LoRA adapter. A
result over the job's or the worker's byte limit is refused ``too_large`` before any forward;
a flood of hidden jobs leaves the worker's RSS flat."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.adapters import save_lora
from tests.support.daemon import thread_worker
from tests.support.models import random_tokens, tiny_causal
from worker.client import ScoringClient, TooLargeError
from worker.executor import ExecutorConfig, StatelessExecutor
from worker.executor.weights.residency import WeightsConfig

pytestmark = pytest.mark.redis

VOCAB = 96
ROOT = Path(__file__).resolve().parents[2]


def _recipe() -> Any:
    path = ROOT / "docs" / "examples" / "hidden_logps.py"
    spec = importlib.util.spec_from_file_location("hidden_logps_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _small(cls: Any, **extra: Any) -> Any:
    common = {
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "initializer_range": 0.3, "tie_word_embeddings": False,
    }  # fmt: skip
    return cls(**{**common, **extra})


def _model(arch: str) -> torch.nn.Module:
    """A tiny float32 causal LM whose logit transform bites."""
    import transformers as tf

    torch.manual_seed(0)
    if arch in ("llama", "gpt2"):  # gpt2: the head tied to the input embedding
        return tiny_causal(arch, vocab=VOCAB).float().eval()
    if arch == "gemma2":
        cfg = _small(tf.Gemma2Config, head_dim=8, final_logit_softcapping=1.5,
                     attn_implementation="eager")  # fmt: skip
        return tf.Gemma2ForCausalLM(cfg).eval()
    if arch == "cohere":
        return tf.CohereForCausalLM(_small(tf.CohereConfig, logit_scale=0.4)).eval()
    if arch == "phi":  # its lm_head has a bias
        model = tf.PhiForCausalLM(_small(tf.PhiConfig, resid_pdrop=0.0, embd_pdrop=0.0))
        with torch.no_grad():
            model.lm_head.bias.normal_(0.0, 1.0)
        return model.eval()
    raise ValueError(arch)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("hidden")
    out = {}
    for arch in ("llama", "gemma2", "cohere", "phi", "gpt2"):
        _model(arch).save_pretrained(str(root / arch))
        out[arch] = root / arch
    yield out


def _load(path: Path, **config: Any) -> StatelessExecutor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    weights = config.pop("weights", None)
    config = {"packing": "packed", "min_shared_tokens": 8, **config}
    return StatelessExecutor(ExecutorConfig(**config), model, weights=weights)


def _group() -> list[dict[str, Any]]:
    """A GRPO-like group: one 12-token prompt, four completions (a tree row when shared)."""
    prompt = random_tokens(12, 1, vocab=VOCAB)
    return [
        {"tokens": [*prompt, 1 + i, *random_tokens(5 + 3 * i, 10 + i, vocab=VOCAB)],
         "prompt_len": len(prompt)}
        for i in range(4)
    ]  # fmt: skip


def _unrelated() -> list[dict[str, Any]]:
    return [
        {"tokens": random_tokens(9 + 4 * i, 30 + i, vocab=VOCAB), "prompt_len": 2 + i}
        for i in range(3)
    ]


def _check(
    seqs: list[dict[str, Any]], scores: Any, info: dict[str, Any], path: Path, dtype: str
) -> None:
    """Every sequence's hidden rows, through the recipe, give its logps."""
    recipe = _recipe()
    head = info["head"]
    weight, bias = recipe.load_head(path, head)
    for seq, got in zip(seqs, scores, strict=True):
        labels = torch.tensor(seq["tokens"][seq["prompt_len"] :])
        assert got.hidden.shape == (len(labels), head["hidden_size"])
        assert got.hidden_dtype == dtype
        hidden = torch.from_numpy(np.array(got.hidden)).to(getattr(torch, dtype))
        np.testing.assert_array_equal(hidden.float().numpy(), got.hidden)  # exact upcast
        mine = recipe.token_logps(hidden, labels, weight, bias, head).numpy()
        if dtype == "float32":
            np.testing.assert_allclose(mine, got.logps, atol=1e-5, rtol=0)
            continue
        # bfloat16 rows: each element within 2^-8 of the exact one (relative), so every logit
        # within 2^-8 (|h| @ |W|^T) (times the transform's gain, / T) and a log-prob within
        # twice the largest of those
        exact = torch.from_numpy(np.asarray(got.hidden, np.float32)).abs()
        gain = abs(head["logit_scale"] or 1.0) / (head["logits_divisor"] or 1.0)
        per_logit = 2.0**-8 * (exact @ weight.float().abs().T) * gain / head["temperature"]
        bound = 2 * per_logit.amax(dim=1).numpy()
        assert np.all(np.abs(mine - got.logps) <= bound + 1e-6), (mine - got.logps, bound)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("arch", ["llama", "gemma2", "cohere", "phi", "gpt2"])
def test_hidden_rows_times_the_checkpoints_head_give_the_workers_logps(
    arch: str, checkpoints: dict[str, Path], redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    executor = _load(checkpoints[arch])
    assert executor.info["head"]["hidden_size"] == 32
    assert executor.layout == "packed", executor.load_fallbacks  # unrelated sequences: packed
    group, alone = _group(), _unrelated()
    with (
        thread_worker(redis_url, key_prefix, executor),
        ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True) as client,
    ):
        results = {}
        for name, seqs in (("tree", group), ("packed", alone)):
            for dtype in ("float32", "bfloat16"):
                handle = client.submit(
                    seqs, outputs=("logps", "hidden", "entropy"), hidden_dtype=dtype,
                    temperature=0.7,
                )  # fmt: skip
                results[name, dtype] = (seqs, client.result(handle, timeout=60))
        half = client.score(alone[:1], outputs=("hidden",), hidden_dtype="float16", timeout=60)
    for (name, dtype), (seqs, result) in results.items():
        head = result.info["head"]
        assert head["temperature"] == 0.7
        if name == "tree":  # the shared prompt ran once: tree rows
            assert result.info["shared_tokens"] > 0, result.info
        else:
            assert result.info["shared_tokens"] == 0
        _check(seqs, result.seqs, result.info, checkpoints[arch], dtype)
    want = {"gemma2": "softcap", "cohere": "logit_scale", "phi": "bias", "gpt2": "tied"}
    if arch in want:
        assert head[want[arch]] is not None, head
    assert half[0].hidden.dtype == np.float16 and half[0].logps is None
    np.testing.assert_allclose(
        half[0].hidden,
        results["packed", "float32"][1].seqs[0].hidden.astype(np.float16),
        rtol=2**-10,  # one float16 step: alone, not in a packed row, float32 rounds apart
        atol=1e-6,
    )


@pytest.mark.timeout(240)
def test_hidden_rows_under_a_lora_adapter(
    tmp_path: Path, redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    """A per-job LoRA adapter (attention and MLP; the head is the base's): the rows are the
    adapted model's and the base checkpoint's head gives the adapted log-probs."""
    base = tiny_causal("llama", vocab=VOCAB)
    base.save_pretrained(str(tmp_path / "base"))
    save_lora(base, tmp_path / "adapters" / "a1", seed=3)
    weights = WeightsConfig(adapter_root=str(tmp_path / "adapters"))
    executor = _load(tmp_path / "base", weights=weights)
    seqs = _group()
    with (
        thread_worker(redis_url, key_prefix, executor),
        ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True) as client,
    ):
        adapted = client.submit(seqs, outputs=("logps", "hidden"), hidden_dtype="float32",
                                adapter="a1")  # fmt: skip
        plain = client.submit(seqs, outputs=("logps", "hidden"), hidden_dtype="float32")
        got, ref = client.result(adapted, timeout=60), client.result(plain, timeout=60)
    assert got.info["adapter"] == "a1"
    _check(seqs, got.seqs, got.info, tmp_path / "base", "float32")
    assert not np.allclose(got.seqs[0].logps, ref.seqs[0].logps, atol=1e-3)  # it bit


@pytest.mark.timeout(120)
def test_hidden_rows_in_both_mode_come_with_the_reward(
    checkpoints: dict[str, Path], redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    from transformers import AutoModelForCausalLM

    from tests.support.models import tiny_reward

    model = AutoModelForCausalLM.from_pretrained(str(checkpoints["llama"]))
    executor = StatelessExecutor(
        ExecutorConfig(mode="both"), model, tiny_reward("llama", vocab=VOCAB)
    )
    seqs = _unrelated()
    with (
        thread_worker(redis_url, key_prefix, executor),
        ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True) as client,
    ):
        handle = client.submit(seqs, mode="both", outputs=("logps", "hidden"),
                               hidden_dtype="float32")  # fmt: skip
        result = client.result(handle, timeout=60)
    assert all(s.reward is not None for s in result.seqs)
    _check(seqs, result.seqs, result.info, checkpoints["llama"], "float32")


@pytest.mark.timeout(120)
def test_a_hidden_job_over_the_limits_is_refused_before_its_forward(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    executor = StatelessExecutor(ExecutorConfig(), tiny_causal("llama", vocab=VOCAB))
    runs: list[int] = []
    real_run = executor.run

    def counted(batch: Any) -> Any:
        runs.append(len(batch))
        return real_run(batch)

    executor.run = counted  # type: ignore[method-assign]
    seqs = [{"tokens": random_tokens(40, 5, vocab=VOCAB), "prompt_len": 8}]  # 32 scored
    size = 32 * (32 * 4 + 4)  # float32 rows of H = 32 and the logps
    with (
        thread_worker(redis_url, key_prefix, executor, max_result_bytes=4000),
        ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True) as client,
    ):
        with pytest.raises(TooLargeError) as server:
            client.score(seqs, outputs=("logps", "hidden"), hidden_dtype="float32", timeout=60)
        from worker.request import ScoreOptions, TokenOutputs

        own = ScoreOptions(outputs=TokenOutputs(("hidden",), max_result_bytes=1000))
        with pytest.raises(TooLargeError) as job:
            client.score(seqs, options=own, timeout=60)
        assert not runs  # neither reached the scorer
        fits = client.score(seqs, outputs=("hidden",), timeout=60)  # 32 x 64 bytes in bf16
    assert f"the result would be {size} bytes" in str(server.value)
    assert "this worker's limit of 4000 bytes" in str(server.value)
    assert server.value.code == "too_large"
    assert "would be 2048 bytes" in str(job.value) and "max_result_bytes of 1000" in str(job.value)
    assert fits[0].hidden.shape == (32, 32) and runs == [1]


def _rss_bytes() -> int:
    """Resident bytes of this process, garbage collected and the heap's freed pages handed
    back first (glibc ``malloc_trim``; a no-op elsewhere)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.timeout(240)
def test_a_flood_of_hidden_jobs_leaves_rss_bounded(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    """120 jobs of 1 MiB of float32 rows each (4 x 256 scored x H = 256): what the worker and
    the client hold grows by far less than what went through them (a client or worker that
    kept every result grows by about 110 MiB). The warm-up has 20 jobs in flight, the measured
    floods 5 each: the allocator keeps the high-water mark of results in flight at once, which
    varies with thread timing, so measured floods as wide as the warm-up could raise it by
    tens of MiB without anything being kept."""
    executor = StatelessExecutor(
        ExecutorConfig(),
        tiny_causal(
            "llama",
            vocab=VOCAB,
            hidden_size=256,
            intermediate_size=256,
            max_position_embeddings=512,
        ),
    )
    seqs = [{"tokens": random_tokens(264, 40 + i, vocab=VOCAB), "prompt_len": 8} for i in range(4)]
    with (
        thread_worker(redis_url, key_prefix, executor),
        ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True) as client,
    ):

        def flood(n: int) -> None:
            handles = [
                client.submit(seqs, outputs=("hidden",), hidden_dtype="float32") for _ in range(n)
            ]
            for h in handles:
                assert client.result(h, timeout=120)[3].hidden.shape == (256, 256)

        flood(20)  # warm: allocator pools, the model's buffers
        before = _rss_bytes()
        for _ in range(20):
            flood(5)
        grown = _rss_bytes() - before
    assert grown < 40 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB over 100 MiB of results"
