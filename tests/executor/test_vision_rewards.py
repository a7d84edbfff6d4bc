"""Rewards with images: a ``Gemma3ForSequenceClassification`` reward model, a Qwen2.5-VL read
through a value head, ``mode="both"`` with one model (one backbone forward) and with a separate
image-text reward model, each equal to transformers' own forward of every sequence alone with
its processor's output; the refusals that remain are ``bad_request`` with their reason."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.support.models import tiny_reward
from tests.support.vision import IMAGE, image_file, image_tokens, placeholder, reference
from tests.support.vision_fixed import fixed_placeholder, fixed_reference, processed
from worker.demo.tiny import tiny_fixed_vlm, tiny_vlm, tiny_vlm_reward
from worker.errors import BadRequest
from worker.executor import ExecutorConfig, StatelessExecutor
from worker.executor.rewards.pooling import SequenceClassificationAdapter, ValueHeadAdapter
from worker.executor.vision import features
from worker.request import Images, ScoreRequest, SequenceInput

A, B = image_file(90, 60, seed=1), image_file(50, 100, seed=2, fmt="WEBP")
FILES = (A, B)


def gemma_seqs(model: Any) -> list[tuple[list[int], list[int]]]:
    """Sequences showing A, A then B, and a text-only one (Gemma-3's 4 tokens per image)."""
    p = fixed_placeholder(model, 4)
    return [([1, 2, *p, 3, 4, 5], [0]), ([6, *p, 7, *p, 8, 9], [0, 1]), ([7, 8, 9, 10], [])]


def request_of(
    seqs: list[tuple[list[int], list[int]]], mode: str, files: tuple[bytes, ...] = FILES
) -> ScoreRequest:
    inputs = [SequenceInput(tokens=t, prompt_len=2, images=tuple(r)) for t, r in seqs]
    return ScoreRequest(inputs, mode=mode, images=Images(files))  # type: ignore[arg-type]


def scored(logps: np.ndarray, tokens: list[int]) -> np.ndarray:
    """The naive per-position log-probs (``t >= 1``) at the scored positions: from the prompt
    (2) on, image tokens never scored."""
    return np.array([logps[t - 1] for t in range(2, len(tokens)) if tokens[t] != IMAGE])


def gemma_reward(model: Any, processor: Any, tokens: list[int], refs: list[int]) -> float:
    """``Gemma3ForSequenceClassification``'s own forward of one sequence alone: its processor's
    ``pixel_values``, ``token_type_ids`` as ``Gemma3Processor`` makes them, its own pooling at
    the last non-pad token."""
    ids = torch.tensor([tokens])
    extra: dict[str, Any] = {"token_type_ids": (ids == IMAGE).long()}
    if refs:
        extra["pixel_values"] = processed(processor, [FILES[r] for r in refs])["pixel_values"]
    with torch.no_grad():
        return float(model(input_ids=ids, use_cache=False, **extra).logits[0, 0])


@pytest.fixture(scope="module")
def gemma_rm() -> tuple[Any, Any]:
    return tiny_vlm_reward(seed=1)


def test_an_image_text_reward_model_scores_images_as_its_own_forward(
    gemma_rm: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rewards of image sequences from ``Gemma3ForSequenceClassification`` equal its own forward
    of each alone (token types passed: without them image tokens would run causally); the
    vision tower runs once per distinct image of the call."""
    model, processor = gemma_rm
    config = ExecutorConfig(dtype="float32", mode="reward")
    ex = StatelessExecutor(config, None, model, reward_image_processor=processor)
    assert ex.info["reward_vision"]["model"] == "Gemma3ForSequenceClassification"
    seqs = gemma_seqs(model)
    ran: list[int] = []
    inner = features.image_inputs

    def counted(vlm: Any, images: Any, *args: Any, **kwargs: Any) -> Any:
        out = inner(vlm, images, *args, **kwargs)
        ran.append(out[1])
        return out

    monkeypatch.setattr(features, "image_inputs", counted)
    got = ex.run([ex.prepare(request_of(seqs, "reward"))]).scores
    for (tokens, refs), score in zip(seqs, got, strict=True):
        assert score.reward is not None
        assert abs(score.reward - gemma_reward(model, processor, tokens, refs)) < 2e-5
    assert sum(ran) == 2  # A and B, once each
    ex.close()


def test_gemma3_reference_and_its_reward_model_in_both_mode(gemma_rm: tuple[Any, Any]) -> None:
    """A Gemma-3 reference model and a separate ``Gemma3ForSequenceClassification``, each with
    its own processor: log-probs and rewards of ``mode="both"`` each equal their naive
    references (the job runs as a reference call and a reward call)."""
    reward, reward_processor = gemma_rm
    ref, processor = tiny_fixed_vlm("gemma3", seed=4)
    config = ExecutorConfig(dtype="float32", mode="both")
    ex = StatelessExecutor(
        config, ref, reward, image_processor=processor, reward_image_processor=reward_processor
    )
    seqs = gemma_seqs(ref)
    prepared = ex.prepare(request_of(seqs, "both"))
    assert [c.mode for c in prepared.plan] == ["reference", "reward"]
    got = ex.run([prepared]).scores
    for (tokens, refs), score in zip(seqs, got, strict=True):
        want = scored(fixed_reference(ref, processor, FILES, tokens, refs)["logps"], tokens)
        assert score.logps is not None and np.abs(score.logps - want).max() < 2e-5
        assert score.reward is not None
        assert abs(score.reward - gemma_reward(reward, reward_processor, tokens, refs)) < 2e-5
    ex.close()


def qwen_seqs(processor: Any) -> list[tuple[list[int], list[int]]]:
    pa, pb = placeholder(image_tokens(processor, A)), placeholder(image_tokens(processor, B))
    return [([1, 2, *pa, 3, 4, 5], [0]), ([6, *pa, 7, *pb, 8, 9], [0, 1]), ([7, 8, 9, 10], [])]


def qwen_value(
    model: Any, processor: Any, head: torch.nn.Module, tokens: list[int], refs: list[int]
) -> float:
    """A value head on Qwen2.5-VL's own forward of one sequence alone (mRoPE positions by
    ``get_rope_index``, its processor's output), read at the last token."""
    ids = torch.tensor([tokens])
    types = (ids == IMAGE).int()
    extra: dict[str, Any] = {}
    grids = None
    if refs:
        out = processed(processor, [FILES[r] for r in refs])
        grids = out["image_grid_thw"]
        extra = {"pixel_values": out["pixel_values"], "image_grid_thw": grids}
    pos, _ = model.model.get_rope_index(ids, types, image_grid_thw=grids)
    with torch.no_grad():
        hidden = model.model(
            input_ids=ids, position_ids=pos, mm_token_type_ids=types, use_cache=False, **extra
        ).last_hidden_state  # [1, L, H]
        return float(head(hidden[0, -1]))


@pytest.mark.parametrize("packing", ["padded", "packed"])
def test_one_qwen25_vl_serves_log_probs_and_a_value_head_in_one_forward(
    packing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen2.5-VL has no ``*ForSequenceClassification``: its reward is a value head on its last
    hidden states (``ValueHeadAdapter``, a ``HiddenStateRewardAdapter``); in ``mode="both"``
    one backbone forward gives log-probs and rewards, each equal to the model's own forward of
    every sequence alone (mRoPE positions, its processor's output), in padded buckets and in
    packed rows (4-row positions); ``mode="reward"`` gives the same rewards."""
    model, processor = tiny_vlm("qwen2_5_vl", seed=3)
    head = torch.nn.Linear(32, 1)
    torch.nn.init.normal_(head.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    config = ExecutorConfig(dtype="float32", mode="both", packing=packing)  # type: ignore[arg-type]
    ex = StatelessExecutor(
        config, model, reward_adapter=ValueHeadAdapter(head), image_processor=processor
    )
    assert ex.layout == packing
    seqs = qwen_seqs(processor)
    prepared = ex.prepare(request_of(seqs, "both"))
    assert [c.mode for c in prepared.plan] == ["both"]
    backbone = type(model.model)
    forwards: list[int] = []
    inner = backbone.forward

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        forwards.append(1)
        return inner(self, *args, **kwargs)

    monkeypatch.setattr(backbone, "forward", counted)
    result = ex.run([prepared])
    got = result.scores
    assert len(forwards) == result.metrics.forwards  # one backbone forward per batch, not two
    monkeypatch.undo()
    if packing == "packed":
        assert result.metrics.packed  # the image sequences ran in packed rows
    alone = ex.run([ex.prepare(request_of(seqs, "reward"))]).scores
    for k, ((tokens, refs), score) in enumerate(zip(seqs, got, strict=True)):
        want = scored(reference(model, processor, FILES, tokens, refs)["logps"], tokens)
        assert score.logps is not None and np.abs(score.logps - want).max() < 2e-5
        want_reward = qwen_value(model, processor, head, tokens, refs)
        assert score.reward is not None and abs(score.reward - want_reward) < 2e-5
        assert alone[k].reward is not None and abs(alone[k].reward - want_reward) < 2e-5
    ex.close()


def test_a_text_reward_model_refuses_images_in_both_mode() -> None:
    """A VLM reference with a text-only reward model: a ``both`` job with images is refused
    whole (the reward would ignore the images), naming the reward model; the same images in
    mode ``reference`` and text jobs in ``both`` are served."""
    ref, processor = tiny_fixed_vlm("gemma3", seed=4)
    ex = StatelessExecutor(
        ExecutorConfig(dtype="float32", self_check=False), ref, tiny_reward(),
        image_processor=processor,
    )  # fmt: skip
    seqs = gemma_seqs(ref)
    with pytest.raises(
        BadRequest, match="reward model LlamaForSequenceClassification is text-only"
    ):
        ex.prepare(request_of(seqs, "both"))
    with pytest.raises(BadRequest, match="is text-only"):
        ex.prepare(request_of(seqs, "reward"))
    got = ex.run([ex.prepare(request_of(seqs, "reference"))]).scores
    assert all(s.logps is not None for s in got)
    text = ScoreRequest([SequenceInput([1, 2, 3, 4], 2)], mode="both")
    assert ex.run([ex.prepare(text)]).scores[0].reward is not None
    ex.close()


def test_a_reward_placeholder_off_by_one_is_refused_naming_the_sequence(
    gemma_rm: tuple[Any, Any],
) -> None:
    """The reward model's own processor counts each image's tokens: a run one short is
    ``bad_request`` naming the sequence and both counts."""
    model, processor = gemma_rm
    config = ExecutorConfig(dtype="float32", mode="reward", self_check=False)
    ex = StatelessExecutor(config, None, model, reward_image_processor=processor)
    short = [
        ([1, 2, *fixed_placeholder(model, 3), 3], [0]),
        ([4, *fixed_placeholder(model, 4)], [1]),
    ]
    with pytest.raises(BadRequest, match=r"sequence 0: .* has 3 image tokens but the processor"):
        ex.prepare(request_of(short, "reward"))
    ex.close()


class CallOnly:
    """A reward adapter that runs the model itself (no ``from_hidden``): the model's own head
    over ``backbone_hidden`` without image inputs."""

    token_level = False

    def __call__(self, model: Any, batch: Any) -> Any:
        return SequenceClassificationAdapter()(model, batch)


def test_images_need_a_hidden_state_adapter_and_matching_counts_for_both_models(
    gemma_rm: tuple[Any, Any],
) -> None:
    """An image-text reward model read by an adapter that runs the model itself cannot be given
    the images (``bad_request`` naming both); in ``both`` mode the tokens are the same for the
    two models, so a reward model whose processor counts other image tokens than the
    reference's refuses the job naming the sequence and both counts."""
    model, processor = gemma_rm
    config = ExecutorConfig(dtype="float32", mode="reward", self_check=False)
    ex = StatelessExecutor(
        config, None, model, reward_adapter=CallOnly(), reward_image_processor=processor
    )
    why = "Gemma3ForSequenceClassification read through CallOnly"
    with pytest.raises(BadRequest, match=why):
        ex.prepare(request_of(gemma_seqs(model), "reward"))
    ex.close()
    ref, ref_processor = tiny_vlm("qwen2_vl", seed=2)
    config = ExecutorConfig(dtype="float32", mode="both", self_check=False)
    ex = StatelessExecutor(
        config, ref, model, image_processor=ref_processor, reward_image_processor=processor
    )
    n, m = image_tokens(ref_processor, A), image_tokens(ref_processor, B)
    qwen = [([1, 2, *placeholder(n), 3, 4], [0]), ([5, 6, *placeholder(m), 7], [1])]
    with pytest.raises(BadRequest, match=rf"sequence 0: .* has {n} image tokens but .* makes 4"):
        ex.prepare(request_of(qwen, "both"))
    ex.close()


def test_a_separate_image_text_reward_model_runs_in_packed_rows(
    gemma_rm: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reward model of its own with images gets the layouts its load check finds exact
    (rewards in packed rows against each sequence alone): ``Gemma3ForSequenceClassification``'s
    image sequences run in packed rows, each reward equal to its own forward alone. With the
    worker's packed block masks dropped, the check finds packed rows wrong and keeps them
    padded, naming why."""
    model, processor = gemma_rm
    config = ExecutorConfig(dtype="float32", mode="reward", packing="packed")
    ex = StatelessExecutor(config, None, model, reward_image_processor=processor)
    assert ex.info["reward_vision"]["layouts"] == "packed, padded"
    seqs = gemma_seqs(model)
    result = ex.run([ex.prepare(request_of(seqs, "reward"))])
    assert result.metrics.packed
    for (tokens, refs), score in zip(seqs, result.scores, strict=True):
        assert score.reward is not None
        assert abs(score.reward - gemma_reward(model, processor, tokens, refs)) < 2e-5
    ex.close()
    monkeypatch.setattr(features, "packed_block_masks", lambda *a, **k: {})
    ex = StatelessExecutor(config, None, model, reward_image_processor=processor)
    assert "disagrees with each sequence alone" in ex.info["reward_vision"]["packed_off"]
    assert ex.info["reward_vision"]["layouts"] == "padded"
    ex.close()


def test_a_separate_vlm_reward_model_shares_a_groups_image_prompt() -> None:
    """A Qwen2.5-VL reference beside a second Qwen2.5-VL read through a value head: the reward
    call of a GRPO group (one prompt with an image, four completions) runs in tree rows, the
    prompt image once through the reward model's tower, each reward equal to the value head on
    the model's own forward of the sequence alone."""
    ref, ref_processor = tiny_vlm("qwen2_5_vl", seed=2)
    model, processor = tiny_vlm("qwen2_5_vl", seed=3)
    head = torch.nn.Linear(32, 1)
    torch.nn.init.normal_(head.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    config = ExecutorConfig(dtype="float32", mode="both", min_shared_tokens=4)
    ex = StatelessExecutor(
        config, ref, model, reward_adapter=ValueHeadAdapter(head),
        image_processor=ref_processor, reward_image_processor=processor,
    )  # fmt: skip
    assert ex.info["reward_vision"]["prefix_sharing"] == "on"
    prompt = [1, 2, *placeholder(image_tokens(processor, A)), 3]
    seqs = [([*prompt, 10 + k, 20 + k, 30 + k], [0]) for k in range(4)]
    result = ex.run([ex.prepare(request_of(seqs, "reward", (A,)))])
    assert result.metrics.shared_prefix_tokens > 0 and result.metrics.vision_images == 1
    for (tokens, refs), score in zip(seqs, result.scores, strict=True):
        want = qwen_value(model, processor, head, tokens, refs)
        assert score.reward is not None and abs(score.reward - want) < 2e-5
    ex.close()
