"""Image sequences of every served architecture through a real worker (real Redis, the daemon in
a thread) in packed rows, masked padded buckets and prefix trees: log-probs with a temperature,
entropy and top-k of a GRPO group sharing a prompt image (one completion showing a tool image in
a later turn), another image's prompt and a text-only sequence, in one job, equal transformers'
own forward of each sequence alone within 2e-5; the group's prompt is computed once (the
worker's shared-prefix counter) and each image goes through the vision tower once, except where
the load check keeps tree rows off (Gemma-3)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.support.daemon import thread_worker
from tests.support.vision import image_file, image_tokens
from tests.support.vision import placeholder as qwen_placeholder
from tests.support.vision import reference as qwen_reference
from tests.support.vision_fixed import fixed_placeholder, fixed_reference, image_count
from tests.support.vision_more import MORE_VLM_ARCHS, more_reference, tiny_more_vlm
from tests.support.vision_more import placeholder as more_placeholder
from worker.client import ScoringClient
from worker.demo.tiny import FIXED_VLM_ARCHS, VLM_ARCHS, tiny_vlm
from worker.executor import ExecutorConfig, StatelessExecutor

pytestmark = pytest.mark.redis

A, B = image_file(90, 60, seed=1), image_file(50, 100, seed=2, fmt="JPEG")
ARCHS = (*VLM_ARCHS, *FIXED_VLM_ARCHS, *MORE_VLM_ARCHS)
TEMP, K = 0.8, 3


def _built(arch: str) -> tuple[Any, Any]:
    return tiny_more_vlm(arch, seed=6) if arch in MORE_VLM_ARCHS else tiny_vlm(arch, seed=6)


def _placeholder(arch: str, model: Any, processor: Any, data: bytes) -> list[int]:
    if arch in MORE_VLM_ARCHS:
        return more_placeholder(model, processor, data)
    if arch in VLM_ARCHS:
        return qwen_placeholder(image_tokens(processor, data))
    return fixed_placeholder(model, image_count(model, processor, data))


def _reference(arch: str, model: Any, processor: Any, tokens: list[int], refs: list[int]) -> Any:
    run = (
        more_reference
        if arch in MORE_VLM_ARCHS
        else qwen_reference
        if arch in VLM_ARCHS
        else fixed_reference
    )
    return run(model, processor, [A, B], tokens, refs, temperature=TEMP, topk=K)


@pytest.fixture(params=[(a, p) for a in ARCHS for p in ("packed", "padded")], ids=str)
def served(
    request: pytest.FixtureRequest, redis_url: str, key_prefix: str, cleanup_keys: None
) -> Iterator[tuple[str, Any, Any, Any, Any]]:
    arch, packing = request.param
    model, processor = _built(arch)
    config = ExecutorConfig(dtype="float32", packing=packing, min_shared_tokens=4)
    ex = StatelessExecutor(config, model, image_processor=processor)
    with thread_worker(redis_url, key_prefix, ex) as (_worker, registry):
        yield arch, model, processor, ex, registry
    ex.close()


def test_every_layout_equals_each_sequence_alone_through_redis(
    served: tuple[str, Any, Any, Any, Any], redis_url: str, key_prefix: str
) -> None:
    arch, model, processor, ex, registry = served
    pa, pb = (_placeholder(arch, model, processor, f) for f in (A, B))
    prompt = [1, 2, *pa, 3, 4, 5]
    seqs = [
        ([*prompt, 6, 7, 8], [0]),
        ([*prompt, 9, 10], [0]),
        ([*prompt, 11, *pb, 12, 13], [0, 1]),
        ([1, 2, *pb, 3, 4, 5, 6, 7], [1]),
        ([7, 8, 9, 10, 11, 12], []),
    ]
    starts = [len(prompt)] * 3 + [len(pb) + 5, 2]
    specs = [
        {"tokens": t, "prompt_len": p, "images": r} for (t, r), p in zip(seqs, starts, strict=True)
    ]
    with ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True) as client:
        got = client.score(
            specs, temperature=TEMP, outputs=("logps", "entropy", "topk"), topk=K,
            images=[A, B], timeout=120,
        )  # fmt: skip
    token = model.config.image_token_id
    for (tokens, refs), p, score in zip(seqs, starts, got, strict=True):
        want = _reference(arch, model, processor, tokens, refs)
        at = np.array([t - 1 for t in range(p, len(tokens)) if tokens[t] != token])
        np.testing.assert_allclose(score.logps, want["logps"][at], atol=2e-5, rtol=0)
        np.testing.assert_allclose(score.entropy, want["entropy"][at], atol=2e-5, rtol=0)
        np.testing.assert_allclose(score.topk_logps, want["topk_logps"][at], atol=2e-5, rtol=0)
        np.testing.assert_array_equal(score.topk_ids, want["topk_ids"][at])
    layouts = ex.info["vision"]["layouts"].split(", ")
    assert layouts[0] == ex.config.packing, ex.info["vision"]  # the load check allowed it
    shared = registry.get_sample_value("scoring_shared_prefix_tokens_total") or 0
    trees = ex.info["vision"]["prefix_sharing"] == "on"
    assert trees is (arch != "gemma3")
    assert shared == (len(prompt) if trees else 0)  # the group's prompt: one shared node
    assert registry.get_sample_value("scoring_vision_tower_images_total") == 2  # A and B once
