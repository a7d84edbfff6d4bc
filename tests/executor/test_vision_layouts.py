"""Image sequences in packed rows, unmasked and padded buckets, and prefix trees, for every served
vision-language architecture: log-probs with a temperature, entropy and top-k equal
transformers' own forward of each sequence alone (its processor's output from the same bytes)
within 2e-5; a GRPO group's prompt image runs through the vision tower once and its tokens are
computed once; prompts that differ only in their image never share its tokens; the traps fail
when reintroduced (three-row positions in packed rows, a tree node cut inside an image); the
load check settles the layouts and names why one is off (Gemma-3: no tree rows); Gemma-3's
packed rows run on the worker's own masks (transformers' sliding mask reads the image blocks
at the wrong tokens there)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.vision import image_file, image_tokens, placeholder, reference
from tests.support.vision_fixed import fixed_placeholder, fixed_reference, image_count
from worker.demo.tiny import FIXED_VLM_ARCHS, VLM_ARCHS, tiny_vlm
from worker.executor import ExecutorConfig, StatelessExecutor
from worker.executor import forward as forward_module
from worker.executor.vision import layout as layout_module
from worker.executor.vision.layout import cuts_image, share_keys
from worker.request import Images, ScoreOptions, ScoreRequest, SequenceInput
from worker.scorer.teacher import TokenOutputs

A, B = image_file(90, 60, seed=1), image_file(50, 100, seed=2, fmt="WEBP")
ARCHS = (*VLM_ARCHS, *FIXED_VLM_ARCHS)
TEMP, K = 1.3, 3


@pytest.fixture(scope="module", params=ARCHS)
def built(request: pytest.FixtureRequest) -> Any:
    return request.param, *tiny_vlm(request.param, seed=4)


def _executor(built: Any, **config: Any) -> StatelessExecutor:
    _, model, processor = built
    settings = {"dtype": "float32", "min_shared_tokens": 4, **config}
    return StatelessExecutor(ExecutorConfig(**settings), model, image_processor=processor)


def _wrap(model: Any, n: int) -> list[int]:
    """One image's placeholder run as the model's processor writes it."""
    if model.config.model_type in VLM_ARCHS:
        return placeholder(n)
    return fixed_placeholder(model, n)


def _count(model: Any, processor: Any, data: bytes) -> int:
    if model.config.model_type in VLM_ARCHS:
        return image_tokens(processor, data)
    return image_count(model, processor, data)


def _want(model: Any, processor: Any, tokens: list[int], refs: list[int]) -> dict[str, Any]:
    run = reference if model.config.model_type in VLM_ARCHS else fixed_reference
    return run(model, processor, [A, B], tokens, refs, temperature=TEMP, topk=K)


def _job(model: Any, processor: Any) -> list[tuple[list[int], list[int], int]]:
    """A GRPO group of three sharing a prompt with image A, one completion showing a tool image
    (B) in a later turn, a prompt like the group's but with image B, a text-only sequence; each
    (tokens, refs, prompt_len)."""
    pa, pb = (_wrap(model, _count(model, processor, f)) for f in (A, B))
    prompt = [1, 2, *pa, 3, 4, 5]
    return [
        ([*prompt, 6, 7, 8], [0], len(prompt)),
        ([*prompt, 9, 10], [0], len(prompt)),
        ([*prompt, 11, *pb, 12, 13], [0, 1], len(prompt)),
        ([1, 2, *pb, 3, 4, 5, 6, 7], [1], len(pb) + 5),
        ([7, 8, 9, 10, 11, 12], [], 2),
    ]


def _score(ex: StatelessExecutor, seqs: list[tuple[list[int], list[int], int]]) -> Any:
    inputs = [SequenceInput(tokens=t, prompt_len=p, images=tuple(r)) for t, r, p in seqs]
    options = ScoreOptions(outputs=TokenOutputs(("logps", "entropy", "topk"), topk=K))
    request = ScoreRequest(inputs, temperature=TEMP, images=Images((A, B)), options=options)
    return ex.run([ex.prepare(request)])


def _at(model: Any, tokens: list[int], prompt_len: int) -> np.ndarray:
    """The positions predicting the scored tokens (image tokens in a completion never are)."""
    token = model.config.image_token_id
    return np.array([t - 1 for t in range(prompt_len, len(tokens)) if tokens[t] != token])


def _worst(ex: StatelessExecutor, built: Any) -> float:
    """The largest difference of any output from each sequence alone over ``_job``."""
    _, model, processor = built
    seqs = _job(model, processor)
    out = _score(ex, seqs)
    worst = 0.0
    for (tokens, refs, p), score in zip(seqs, out.scores, strict=True):
        want = _want(model, processor, tokens, refs)
        at = _at(model, tokens, p)
        got = {"logps": score.logps, **(score.arrays or {})}
        for name in ("logps", "entropy", "topk_logps"):
            worst = max(worst, float(np.abs(got[name] - want[name][at]).max()))
        if not np.array_equal(got["topk_ids"], want["topk_ids"][at]):
            worst = float("inf")  # another top-k
    return worst


@pytest.mark.parametrize("packing", ["packed", "unmasked", "padded"])
def test_every_layout_and_tree_rows_equal_each_sequence_alone(built: Any, packing: str) -> None:
    ex = _executor(built, packing=packing)
    try:
        info = ex.info["vision"]
        gemma = built[0] == "gemma3"
        assert info["layouts"].split(", ")[0] == packing, info
        assert (info["prefix_sharing"] == "on") is not gemma, info
        assert _worst(ex, built) < 2e-5
    finally:
        ex.close()


def test_a_group_prompt_image_runs_through_the_tower_once_and_its_tokens_once(
    built: Any,
) -> None:
    arch, model, processor = built
    if arch == "gemma3":
        pytest.skip("Gemma-3's image blocks are bidirectional: no tree rows (tested below)")
    ex = _executor(built, packing="packed")
    try:
        seqs = _job(model, processor)[:3]
        out = _score(ex, seqs)
        prompt = seqs[0][2]
        assert [s.shared_tokens for s in out.scores] == [prompt] * 3
        assert out.metrics.vision_images == 2  # A once for the group, B once
        assert out.metrics.forward_tokens == sum(len(t) for t, _, _ in seqs) - 2 * prompt
    finally:
        ex.close()


def test_prompts_that_differ_only_in_their_image_never_share_it(built: Any) -> None:
    """Three prompts with the same ids, the second showing another picture of the same size:
    the first and third share their whole prompt, the second shares none of its image."""
    arch, model, processor = built
    if arch == "gemma3":
        pytest.skip("Gemma-3's image blocks are bidirectional: no tree rows")
    run = _wrap(model, _count(model, processor, A))
    prompt = [1, 2, 3, 4, 5, *run, 6, 7]
    seqs = [([*prompt, 8 + i, 9, 10], [i % 2], len(prompt)) for i in range(3)]
    ex = _executor(built, packing="packed")
    try:
        inputs = [SequenceInput(tokens=t, prompt_len=p, images=tuple(r)) for t, r, p in seqs]
        out = ex.run([ex.prepare(ScoreRequest(inputs, images=Images((A, A_SAME_SIZE))))])
        image_at = prompt.index(model.config.image_token_id)
        shared = [s.shared_tokens for s in out.scores]
        assert shared[0] == shared[2] == len(prompt) and shared[1] <= image_at, shared
        for (tokens, refs, p), score in zip(seqs, out.scores, strict=True):
            files = [A, A_SAME_SIZE]
            run_ref = reference if arch in VLM_ARCHS else fixed_reference
            want = run_ref(model, processor, files, tokens, refs)["logps"][p - 1 :]
            assert float(np.abs(score.logps - want).max()) < 2e-5
    finally:
        ex.close()


A_SAME_SIZE = image_file(90, 60, seed=9)  # another picture, the same grid as A


def test_share_keys_tell_images_apart_and_a_cut_inside_an_image_is_found(built: Any) -> None:
    _, model, processor = built
    ex = _executor(built, packing="packed")
    try:
        n = _count(model, processor, A)
        token = model.config.image_token_id
        run = _wrap(model, n)
        tokens = [1, 2, *run, 3]
        inputs = [SequenceInput(tokens=tokens, prompt_len=2, images=(i,)) for i in (0, 1, 0)]
        request = ScoreRequest(inputs, images=Images((A, A_SAME_SIZE)))
        seqs = list(ex.prepare(request).plan[0].seqs)
        keys = share_keys(seqs, token)
        assert (keys[0] == keys[2]).all() and not (keys[0] == keys[1]).all()
        where = np.flatnonzero(seqs[0].ids == token)
        assert (keys[0][where] != token).all() and (seqs[0].ids[where] == token).all()
        from worker.executor.tree.trie import Node, SharedGroup

        inside = SharedGroup((Node(0, int(where[1]), -1),), (0, 2), (0, 0))
        assert cuts_image(inside, keys)
        whole = SharedGroup((Node(0, int(where[-1]) + 1, -1),), (0, 2), (0, 0))
        assert not cuts_image(whole, keys)
    finally:
        ex.close()


def test_three_row_positions_in_packed_rows_are_caught(
    built: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trap: packed rows with mRoPE's three rows only (no text row 0): the model sees one
    sequence per row and attention leaks across sequences."""
    if built[0] not in VLM_ARCHS:
        pytest.skip("1-D positions: no fourth row")
    ex = _executor(built, packing="packed", prefix_sharing="off")
    laid = layout_module.vision_layout

    def three(batch: Any, ordered: Any, token: int, **kw: Any) -> Any:
        out = laid(batch, ordered, token, **kw)
        if out.position_ids.shape[0] == 4:
            out = replace(out, position_ids=out.position_ids[1:])
        return out

    try:
        assert _worst(ex, built) < 2e-5
        monkeypatch.setattr(layout_module, "vision_layout", three)
        assert _worst(ex, built) > 1e-3
    finally:
        ex.close()


def test_the_load_check_keeps_image_sequences_out_of_a_layout_that_disagrees(
    built: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    if built[0] not in VLM_ARCHS:
        pytest.skip("the mRoPE rows are what is broken here")
    laid = layout_module.vision_layout

    def three(batch: Any, ordered: Any, token: int, **kw: Any) -> Any:
        out = laid(batch, ordered, token, **kw)
        if out.position_ids.shape[0] == 4 and any(s.vision is not None for s in ordered):
            out = replace(out, position_ids=out.position_ids[1:])
        return out

    monkeypatch.setattr(layout_module, "vision_layout", three)
    ex = _executor(built, packing="packed")
    try:
        info = ex.info["vision"]
        assert info["layouts"] == "padded" and "disagrees" in info["packed_off"], info
        assert ex.layout == "packed"  # text keeps its layout
        monkeypatch.undo()
        assert _worst(ex, built) < 2e-5  # image sequences run padded (and in trees)
    finally:
        ex.close()


def test_gemma3_image_sequences_never_run_in_tree_rows() -> None:
    model, processor = tiny_vlm("gemma3", seed=4)
    ex = _executor(("gemma3", model, processor), packing="packed")
    try:
        info = ex.info["vision"]
        assert "bidirectionally" in info["prefix_sharing"], info
        out = _score(ex, _job(model, processor)[:3])
        assert all(s.shared_tokens == 0 for s in out.scores)
        assert ex.prefix_sharing == "on"  # text sequences still share
    finally:
        ex.close()


def test_gemma3_packed_rows_need_the_workers_own_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``packed_block_masks`` (transformers' own masks from ``token_type_ids``) packed
    image sequences disagree with each alone and the load check keeps them padded; with it
    they run packed and agree."""
    from worker.executor.vision import features

    built = ("gemma3", *tiny_vlm("gemma3", seed=4))
    ex = _executor(built, packing="packed", prefix_sharing="off")
    try:
        assert ex.info["vision"]["layouts"] == "packed, padded", ex.info["vision"]
        assert _worst(ex, built) < 2e-5
        monkeypatch.setattr(features, "packed_block_masks", lambda *a: {})
        assert _worst(ex, built) > 1e-3
    finally:
        ex.close()
    refused = _executor(built, packing="packed", prefix_sharing="off")
    try:
        info = refused.info["vision"]
        assert info["layouts"] == "padded" and "disagrees" in info["packed_off"], info
    finally:
        refused.close()


def test_positions_sit_on_every_token_of_a_tree_row() -> None:
    """Each token of a tree row carries its own sequence's mRoPE position: a shared node's once,
    a continuation's from its member's (which, after an image, differs from its index)."""
    model, processor = tiny_vlm("qwen2_5_vl", seed=4)
    ex = _executor(("qwen2_5_vl", model, processor), packing="packed")
    seen: list[torch.Tensor] = []
    hidden = forward_module.backbone_hidden

    def spy(m: Any, batch: Any, **extra: Any) -> Any:
        seen.append(batch.position_ids)
        return hidden(m, batch, **extra)

    try:
        forward_module.backbone_hidden = spy  # type: ignore[assignment]
        seqs = _job(model, processor)[:3]
        _score(ex, seqs)
    finally:
        forward_module.backbone_hidden = hidden  # type: ignore[assignment]
        ex.close()
    pos = seen[-1]  # [3, 1, T]: one tree row, the prompt once and the three continuations
    p = seqs[0][2]
    assert pos.shape[0] == 3 and pos.shape[-1] == sum(len(t) for t, _, _ in seqs) - 2 * p
    row = pos[:, 0].numpy()
    # each continuation starts where the prompt's positions end (+1), not at its row index
    last = row[:, p - 1].max()
    assert all((row[:, at] == last + 1).all() for at in (p, p + 3, p + 5))
