"""verl 0.9.1's own reward loop scores through the fleet: ``RewardLoopWorker`` (the class verl
runs as a Ray actor, here built in-process without starting Ray) loads ``ScoringRewardManager``
through ``load_reward_manager`` (``reward.reward_manager.source=importlib``) and ``compute_score``
through ``reward.custom_reward_function`` (under verl's ``naive`` manager), both with their
settings in verl's own config (``reward.reward_kwargs``, ``custom_reward_function.reward_kwargs``;
nothing in the environment). The rewards equal the reward model's own logits, read locally from
the checkpoint the worker serves (``serve --reward-model``)."""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.daemon import WorkerProc
from worker.demo.tiny import save_tiny_models
from worker.integrations.shared import close_all

verl_loop = pytest.importorskip("verl.experimental.reward_loop.reward_loop")
verl_protocol = pytest.importorskip("verl.protocol")
omegaconf = pytest.importorskip("omegaconf")

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(300)]

#: (prompt, response) texts of the batch.
SAMPLES = [("Q: 2+2? A:", " 4"), ("Name a colour:", " blue, or red"), ("Hi", "!")]
#: A GRPO-shaped batch, verl's order (each prompt's rollouts together): three rollouts of a
#: prompt longer than the worker's min_shared_tokens (32; one token per byte), two of a short
#: one, one prompt alone.
LONG = "Answer in one word. Which planet is the largest of the solar system? A:"
GROUPS = [
    (LONG, " Jupiter"),
    (LONG, " Saturn, I think"),
    (LONG, " J"),
    ("Name a colour:", " blue"),
    ("Name a colour:", " red, or green"),
    ("Hi", "!"),
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, dict[str, Path]]]:
    """A worker serving the tiny reward model on its own queue: ``(redis_url, queue, paths)``."""
    import uuid

    from tests.conftest import MACHINE_REDIS_URL

    root = tmp_path_factory.mktemp("verl-loop")
    paths = save_tiny_models(root)
    queue = f"verlloop{uuid.uuid4().hex[:8]}"
    worker = WorkerProc(
        ["--redis-url", MACHINE_REDIS_URL, "--queue", queue, "--consumer", "w1",
         "--reward-model", str(paths["tiny-reward"]), "--device", "cpu", "--metrics-port", "0"],
        root / "worker.log",
    )  # fmt: skip
    try:
        worker.wait_ready(120)
        yield MACHINE_REDIS_URL, queue, paths
    finally:
        worker.stop()


def _batch(tokenizer: Any, samples: list[tuple[str, str]] = SAMPLES) -> Any:
    """verl's batch: left-padded ``prompts``, right-padded ``responses``, ``attention_mask``
    over both, and the non-tensor fields its managers read."""
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p, _ in samples]
    responses = [tokenizer.encode(r, add_special_tokens=False) for _, r in samples]
    width_p, width_r = max(map(len, prompts)), max(map(len, responses))
    pad = tokenizer.pad_token_id
    rows_p = [[pad] * (width_p - len(p)) + p for p in prompts]
    rows_r = [r + [pad] * (width_r - len(r)) for r in responses]
    mask = [
        [0] * (width_p - len(p)) + [1] * (len(p) + len(r)) + [0] * (width_r - len(r))
        for p, r in zip(prompts, responses, strict=True)
    ]
    return verl_protocol.DataProto.from_dict(
        tensors={
            "prompts": torch.tensor(rows_p),
            "responses": torch.tensor(rows_r),
            "attention_mask": torch.tensor(mask),
        },
        non_tensors={
            "data_source": np.array(["test"] * len(samples), dtype=object),
            "reward_model": np.array([{"ground_truth": None}] * len(samples), dtype=object),
            "extra_info": np.array([{"prompt": p} for p, _ in samples], dtype=object),
        },
    )


def _config(policy: Path, reward: dict[str, Any]) -> Any:
    base = {
        "custom_reward_function": {"path": None, "name": "compute_score", "reward_kwargs": {}},
        "reward_manager": {
            "source": "register",
            "name": "naive",
            "module": {"path": None, "name": "custom_reward_manager"},
        },
        "reward_model": {"enable": False},
        "sandbox_fusion": {"url": None},
    }
    for key, value in reward.items():
        base[key] = {**base[key], **value} if isinstance(base.get(key), dict) else value
    return omegaconf.OmegaConf.create(
        {"actor_rollout_ref": {"model": {"path": str(policy), "tokenizer_path": None}},
         "reward": base}
    )  # fmt: skip


def _run_loop(config: Any, samples: list[tuple[str, str]] = SAMPLES) -> list[dict[str, Any]]:
    """verl's ``RewardLoopWorker.compute_score_batch`` on the batch, in one event loop."""

    async def run() -> list[dict[str, Any]]:
        try:
            worker = verl_loop.RewardLoopWorker(config)
            return list(await worker.compute_score_batch(_batch(worker.input_tokenizer, samples)))
        finally:
            await close_all()

    return asyncio.run(run())


def _own_rewards(paths: dict[str, Path]) -> list[float]:
    """The reward model's own ``logits[0, 0]`` of each prompt + response text, tokenized by its
    own tokenizer without special tokens (how the worker reads ``text``)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(paths["tiny-reward"])
    model = AutoModelForSequenceClassification.from_pretrained(paths["tiny-reward"]).eval()
    out = []
    with torch.inference_mode():
        for p, r in SAMPLES:
            ids = tokenizer.encode(p + r, add_special_tokens=False)
            out.append(float(model(input_ids=torch.tensor([ids])).logits[0, 0]))
    return out


def _ids_rewards(paths: dict[str, Path], samples: list[tuple[str, str]] = SAMPLES) -> list[float]:
    """The reward model's own score of exactly the policy's prompt + response ids."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(paths["tiny-llama"])
    model = AutoModelForSequenceClassification.from_pretrained(paths["tiny-reward"]).eval()
    out = []
    with torch.inference_mode():
        for p, r in samples:
            ids = tokenizer.encode(p, add_special_tokens=False) + tokenizer.encode(
                r, add_special_tokens=False
            )
            out.append(float(model(input_ids=torch.tensor([ids])).logits[0, 0]))
    return out


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SCORING_REDIS_URL", "SCORING_QUEUE", "SCORING_WAIT_FOR_UNKNOWN_QUEUE"):
        monkeypatch.delenv(name, raising=False)


def _manager_config(paths: dict[str, Path], url: str, queue: str) -> Any:
    """verl's config loading ``ScoringRewardManager`` by importlib, its settings in
    ``reward.reward_kwargs`` (where verl's own managers read theirs)."""
    return _config(
        paths["tiny-llama"],
        {
            "reward_manager": {
                "source": "importlib",
                "name": "ScoringRewardManager",
                "module": {"path": "pkg://worker.integrations.verl_manager"},
            },
            "reward_kwargs": {"redis_url": url, "queue": queue, "timeout_s": 120},
        },
    )


def test_the_manager_through_load_reward_manager_scores_the_policys_ids(
    fleet: tuple[str, str, dict[str, Path]],
) -> None:
    url, queue, paths = fleet
    config = _manager_config(paths, url, queue)
    out = _run_loop(config)
    got = [o["reward_score"] for o in out]
    assert got == pytest.approx(_ids_rewards(paths), abs=1e-4)
    assert all(o["reward_extra_info"] == {"rm_score": o["reward_score"]} for o in out)
    assert len(set(got)) == len(got)  # three different samples, three different rewards


def test_the_manager_sends_each_grpo_prompt_once_with_the_per_sequence_rewards(
    fleet: tuple[str, str, dict[str, Path]],
) -> None:
    """verl's loop on a GRPO batch: one job per prompt of several rollouts, the prompt's ids
    once (``prefix``), each response after it; the prompt alone goes plain. The rewards equal,
    bit for bit, those of the same sequences sent whole in one job (the path before groups),
    and the reward model's own."""
    from tests.support.client import JobTap
    from worker import keys
    from worker.integrations.shared import coalescer
    from worker.integrations.verl_manager import ScoringRewardManager, sequence_of
    from worker.protocol.seqs import le_bytes

    url, queue, paths = fleet
    config = _manager_config(paths, url, queue)
    with JobTap(url, keys.job_streams(queue)) as tap:
        out = _run_loop(config, GROUPS)
        bodies, sent = tap.bodies(), tap.payloads()
    tokenizer = _tokenizer_of(paths)
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in (LONG, "Name a colour:", "Hi")]
    by_prefix = {b.get("prefix"): b for b in bodies}
    assert len(bodies) == len(by_prefix) == 2
    assert len(by_prefix[le_bytes(array("i", ids[0]))]["seqs"]) == 3
    # a 14-token prompt of two rollouts keeps 14 ids off the wire: not worth a job of its own
    assert len(by_prefix[None]["seqs"]) == 3
    whole = [len(tokenizer.encode(p + r, add_special_tokens=False)) for p, r in GROUPS]
    assert _token_bytes(bodies) == 4 * (sum(whole) - 2 * len(ids[0]))  # the long prompt once

    data = _batch(tokenizer, GROUPS)
    manager = ScoringRewardManager(config, None, None)

    async def per_sequence() -> list[float]:
        try:
            batcher = coalescer(manager.redis_url, manager.queue)
            scores = await asyncio.gather(
                *(
                    batcher.score([sequence_of(data[i])], manager.key, 120)
                    for i in range(len(GROUPS))
                )
            )
            return [float(s[0].reward) for s in scores]
        finally:
            await close_all()

    with JobTap(url, keys.job_streams(queue)) as tap:
        want = asyncio.run(per_sequence())
        assert _token_bytes(tap.bodies()) == 4 * sum(whole)  # one job, every sequence whole
        # what the worker decodes is the same either way: the whole sequences, prompt_len 1
        assert _decoded(sent) == _decoded(tap.payloads())
    got = [o["reward_score"] for o in out]
    assert got == want  # exactly: the group's tree row and the rest are the same forwards
    assert got == pytest.approx(_ids_rewards(paths, GROUPS), abs=1e-4)


def _decoded(payloads: list[bytes]) -> list[tuple[tuple[int, ...], int | None]]:
    """The sequences the worker decodes from ``payloads``, sorted: ``(ids, prompt_len)``."""
    from worker.protocol import decode_job

    return sorted((tuple(s.tokens), s.prompt_len) for p in payloads for s in decode_job(p).seqs)


def _token_bytes(bodies: list[dict[str, Any]]) -> int:
    """The bytes of token ids in job bodies: each ``prefix`` and each sequence's ``tokens``."""
    return sum(len(b.get("prefix", b"")) + sum(len(s["tokens"]) for s in b["seqs"]) for b in bodies)


def test_compute_score_through_the_custom_reward_function_scores_the_text(
    fleet: tuple[str, str, dict[str, Path]],
) -> None:
    url, queue, paths = fleet
    config = _config(
        paths["tiny-llama"],
        {
            "custom_reward_function": {
                "path": "pkg://worker.integrations.verl",
                "name": "compute_score",
                "reward_kwargs": {"redis_url": url, "queue": queue, "timeout_s": 120},
            }
        },
    )
    out = _run_loop(config)
    got = [o["reward_score"] for o in out]
    assert got == pytest.approx(_own_rewards(paths), abs=1e-4)


def test_the_manager_reads_custom_reward_function_kwargs_and_refuses_a_typo(
    fleet: tuple[str, str, dict[str, Path]],
) -> None:
    from worker.client import UnknownQueueError
    from worker.integrations.verl_manager import ScoringRewardManager, config_settings

    url, queue, _ = fleet
    config = omegaconf.OmegaConf.create(
        {"reward": {"custom_reward_function": {"reward_kwargs": {"redis_url": url, "queue": "x"}},
                    "reward_kwargs": {"queue": f"{queue}-typo", "partitions": 1}}}
    )  # fmt: skip
    assert config_settings(config) == {"redis_url": url, "queue": f"{queue}-typo", "partitions": 1}
    manager = ScoringRewardManager(config, None, None)
    assert (manager.redis_url, manager.queue, manager.timeout_s) == (url, f"{queue}-typo", 600.0)
    data = _batch(_tokenizer_of(fleet[2]))[0:1]

    async def run() -> Any:
        try:
            return await manager.run_single(data)
        finally:
            await close_all()

    with pytest.raises(UnknownQueueError, match="typo"):
        asyncio.run(asyncio.wait_for(run(), 30))  # at once, not after 600 s


def _tokenizer_of(paths: dict[str, Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(paths["tiny-llama"])
