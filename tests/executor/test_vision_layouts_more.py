"""Image sequences of LLaVA-NeXT, LLaVA-OneVision (anyres), Mistral-3 (a run per image row) and
SmolVLM / Idefics3 with image splitting on (a run per tile and the global image) in packed rows,
unmasked and padded buckets, and prefix trees: the load check lets every layout run them,
and log-probs with a temperature, entropy and top-k equal transformers' own forward of each
sequence alone within 2e-5; a GRPO group's prompt image runs through the vision tower once and
its tokens are computed once, its several runs kept in one shared node."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.support.vision import IMAGE, image_file
from tests.support.vision_more import MORE_VLM_ARCHS, more_reference, placeholder, tiny_more_vlm
from worker.executor import ExecutorConfig, StatelessExecutor
from worker.request import Images, ScoreOptions, ScoreRequest, SequenceInput
from worker.scorer.teacher import TokenOutputs

A, B = image_file(90, 60, seed=1), image_file(50, 100, seed=2, fmt="WEBP")
TEMP, K = 1.3, 3
Job = list[tuple[list[int], list[int], int]]


@pytest.fixture(scope="module", params=MORE_VLM_ARCHS)
def built(request: pytest.FixtureRequest) -> Any:
    return tiny_more_vlm(request.param, seed=4)


def _executor(built: Any, **config: Any) -> StatelessExecutor:
    model, processor = built
    settings = {"dtype": "float32", "min_shared_tokens": 4, **config}
    return StatelessExecutor(ExecutorConfig(**settings), model, image_processor=processor)


def _job(model: Any, processor: Any) -> Job:
    """A GRPO group of three sharing a prompt with image A, one completion showing B in a later
    turn; a prompt like the group's with image B; a text-only sequence: (tokens, refs,
    prompt_len)."""
    pa, pb = (placeholder(model, processor, f) for f in (A, B))
    prompt = [1, 2, *pa, 3, 4, 5]
    return [
        ([*prompt, 6, 7, 8], [0], len(prompt)),
        ([*prompt, 9, 10], [0], len(prompt)),
        ([*prompt, 11, *pb, 12, 13], [0, 1], len(prompt)),
        ([1, 2, *pb, 3, 4, 5, 6, 7], [1], len(pb) + 5),
        ([7, 8, 9, 10, 11, 12], [], 2),
    ]


def _score(ex: StatelessExecutor, seqs: Job) -> Any:
    inputs = [SequenceInput(tokens=t, prompt_len=p, images=tuple(r)) for t, r, p in seqs]
    options = ScoreOptions(outputs=TokenOutputs(("logps", "entropy", "topk"), topk=K))
    request = ScoreRequest(inputs, temperature=TEMP, images=Images((A, B)), options=options)
    return ex.run([ex.prepare(request)])


def _worst(ex: StatelessExecutor, built: Any) -> float:
    """The largest difference of any output from each sequence alone over ``_job`` (inf for
    another top-k)."""
    model, processor = built
    seqs = _job(model, processor)
    out = _score(ex, seqs)
    worst = 0.0
    for (tokens, refs, p), score in zip(seqs, out.scores, strict=True):
        want = more_reference(model, processor, [A, B], tokens, refs, temperature=TEMP, topk=K)
        at = np.array([t - 1 for t in range(p, len(tokens)) if tokens[t] != IMAGE])
        got = {"logps": score.logps, **(score.arrays or {})}
        for name in ("logps", "entropy", "topk_logps"):
            worst = max(worst, float(np.abs(got[name] - want[name][at]).max()))
        if not np.array_equal(got["topk_ids"], want["topk_ids"][at]):
            worst = float("inf")
    return worst


@pytest.mark.parametrize("packing", ["packed", "unmasked", "padded"])
def test_every_layout_and_tree_rows_equal_each_sequence_alone(built: Any, packing: str) -> None:
    ex = _executor(built, packing=packing)
    try:
        info = ex.info["vision"]
        assert info["layouts"].split(", ")[0] == packing, info
        assert info["prefix_sharing"] == "on", info
        assert _worst(ex, built) < 2e-5
    finally:
        ex.close()


@pytest.mark.parametrize("packing", ["packed", "padded"])
def test_a_group_prompt_image_runs_through_the_tower_once_and_its_tokens_once(
    built: Any, packing: str
) -> None:
    model, processor = built
    ex = _executor(built, packing=packing)
    try:
        seqs = _job(model, processor)[:3]
        out = _score(ex, seqs)
        prompt = seqs[0][2]
        assert [s.shared_tokens for s in out.scores] == [prompt] * 3
        assert out.metrics.vision_images == 2  # A once for the group, B once
        assert out.metrics.forward_tokens == sum(len(t) for t, _, _ in seqs) - 2 * prompt
    finally:
        ex.close()


def test_a_node_ending_between_two_runs_of_an_image_cuts_it(built: Any) -> None:
    """A tree node ending after an image's first run (Mistral-3's first row, SmolVLM's first
    tile; inside the one run of anyres models) cuts it; one ending after its last run does
    not."""
    from worker.executor.tree.trie import Node, SharedGroup
    from worker.executor.vision.layout import cuts_image, share_keys

    model, processor = built
    pa = placeholder(model, processor, A)
    first = pa.index(IMAGE)
    end = next((i for i in range(first, len(pa)) if pa[i] != IMAGE), first + 1)
    if end == len(pa) or IMAGE not in pa[end:]:
        end = first + 1  # one run: end inside it
    tokens = [1, 2, *pa, 3]
    ex = _executor(built, packing="packed")
    try:
        inputs = [SequenceInput(tokens=tokens, prompt_len=2, images=(0,)) for _ in range(2)]
        seqs = list(ex.prepare(ScoreRequest(inputs, images=Images((A,)))).plan[0].seqs)
        keys = share_keys(seqs, IMAGE)
        inside = SharedGroup((Node(0, 2 + end, -1),), (0, 1), (0, 0))
        assert cuts_image(inside, keys)
        whole = SharedGroup((Node(0, 2 + len(pa), -1),), (0, 1), (0, 0))
        assert not cuts_image(whole, keys)
    finally:
        ex.close()
