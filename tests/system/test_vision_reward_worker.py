"""Rewards with images through a real worker (real Redis, the daemon in a thread): a tiny Gemma-3
reference and a tiny ``Gemma3ForSequenceClassification`` reward model, each loaded from a
checkpoint saved with its image processor. ``reward`` and ``both`` jobs with images equal
transformers' own forward of each sequence alone (rewards pooled by the model's own head,
log-probs by the reference); a reward run that does not match its image is ``bad_request``
naming the sequence, and the other jobs are answered."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from tests.support.daemon import thread_worker
from tests.support.vision import IMAGE, image_file
from tests.support.vision_fixed import fixed_placeholder, fixed_reference, processed
from worker.client import ScoringClient
from worker.client.errors import BadRequestError
from worker.demo.tiny import save_tiny_vlm, save_tiny_vlm_reward
from worker.executor import ExecutorConfig, StatelessExecutor

pytestmark = pytest.mark.redis

A, B = image_file(90, 60, seed=1), image_file(50, 100, seed=2, fmt="JPEG")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    ref = save_tiny_vlm(tmp_path_factory.mktemp("gemma3"), "gemma3", seed=3)
    return ref, save_tiny_vlm_reward(tmp_path_factory.mktemp("gemma3-rm"), seed=4)


def _naive(path: Path) -> tuple[Any, Any]:
    """A checkpoint loaded by transformers alone (its own architecture), with its processor."""
    config = transformers.AutoConfig.from_pretrained(path)
    cls = getattr(transformers, config.architectures[0])
    model = cls.from_pretrained(path, dtype="float32").eval()
    return model, transformers.AutoImageProcessor.from_pretrained(path)


@pytest.fixture
def served(
    checkpoints: tuple[Path, Path], redis_url: str, key_prefix: str, cleanup_keys: None
) -> Iterator[Any]:
    ref, rm = checkpoints
    ex = StatelessExecutor.from_pretrained(
        ExecutorConfig(dtype="float32", mode="both"), str(ref), str(rm)
    )
    with thread_worker(redis_url, key_prefix, ex) as (worker, _):
        yield worker
    ex.close()


def _reward(model: Any, processor: Any, tokens: list[int], files: list[bytes]) -> float:
    ids = torch.tensor([tokens])
    extra: dict[str, Any] = {"token_type_ids": (ids == IMAGE).long()}
    if files:
        extra["pixel_values"] = processed(processor, files)["pixel_values"]
    with torch.no_grad():
        return float(model(input_ids=ids, use_cache=False, **extra).logits[0, 0])


def test_gemma3_rewards_with_images_equal_the_model_alone_through_redis(
    served: Any, checkpoints: tuple[Path, Path], redis_url: str, key_prefix: str
) -> None:
    ref, rm = (_naive(p) for p in checkpoints)
    p = fixed_placeholder(rm[0], 4)
    seqs = [
        {"tokens": [1, 2, *p, 3, 4, 5], "prompt_len": 2, "images": [0]},
        {"tokens": [6, *p, 7, *p, 8, 9], "prompt_len": 2, "images": [0, 1]},
        {"tokens": [7, 8, 9, 10], "prompt_len": 2},
    ]
    files = [[A], [A, B], []]
    with ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True) as client:
        rewards = client.score(seqs, mode="reward", images=[A, B], timeout=60)
        both = client.score(seqs, mode="both", images=[A, B], timeout=60)
        short = [{"tokens": [1, *fixed_placeholder(rm[0], 3), 2], "prompt_len": 1, "images": [0]}]
        with pytest.raises(BadRequestError, match=r"sequence 0: .* has 3 image tokens"):
            client.score(short, mode="reward", images=[A], timeout=60)
        after = client.score(seqs[:1], mode="reward", images=[A], timeout=60)  # still serving
    for seq, shown, r, b in zip(seqs, files, rewards, both, strict=True):
        want = _reward(*rm, seq["tokens"], shown)
        assert abs(r.reward - want) < 2e-5 and abs(b.reward - want) < 2e-5
        if shown == [A]:
            assert abs(after[0].reward - want) < 2e-5
        tokens = seq["tokens"]
        refs = [0, 1][: len(shown)]
        logps = fixed_reference(*ref, [A, B], tokens, refs)["logps"]
        at = [t - 1 for t in range(2, len(tokens)) if tokens[t] != IMAGE]
        np.testing.assert_allclose(b.logps, logps[at], atol=2e-5, rtol=0)
