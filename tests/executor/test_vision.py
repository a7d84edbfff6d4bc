"""The executor's image path in process (tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL /
Qwen3-VL-MoE): the traps each fail a test when reintroduced (positions not passed, 1-D
positions, a count checked over the batch only, Qwen3-VL's deepstack features dropped or
misplaced),
the vision tower runs once per distinct image and never for text, the processor cache and its
options, placeholders in a completion never scored, and the refusals (other image-text models,
video, a text-only model given images, bad files)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import (
    Idefics2Config,
    InternVLConfig,
    PaliGemmaConfig,
)

from tests.support.models import tiny_causal
from tests.support.vision import IMAGE, VIDEO, image_file, image_tokens, placeholder, reference
from worker.demo.tiny import VLM_ARCHS, save_tiny_vlm, tiny_vlm
from worker.errors import BadRequest, ConfigError
from worker.executor import ExecutorConfig, StatelessExecutor
from worker.executor import forward as forward_module
from worker.executor.vision import layout as layout_module
from worker.executor.vision.arch import DEEPSTACK, served_class, vision_model
from worker.executor.vision.decode import decode_image
from worker.executor.vision.processor import ImageProcessing
from worker.request import Images, ScoreRequest, SequenceInput

A, B = image_file(90, 60, seed=1), image_file(50, 100, seed=2, fmt="WEBP")


@pytest.fixture(scope="module", params=VLM_ARCHS)
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    path: Path = save_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param, seed=5)
    ex = StatelessExecutor.from_pretrained(ExecutorConfig(dtype="float32"), str(path))
    yield ex
    ex.close()


def _processor(ex: StatelessExecutor) -> Any:
    assert ex._vision is not None
    return ex._vision.processing.processor


def _job(ex: StatelessExecutor) -> tuple[ScoreRequest, list[tuple[list[int], list[int], int]]]:
    """Three sequences showing A, A then B, and B twice; each (tokens, refs, prompt_len)."""
    na, nb = image_tokens(_processor(ex), A), image_tokens(_processor(ex), B)
    seqs = [
        ([1, 2, *placeholder(na), 3, 4, 5], [0], na + 5),
        ([6, *placeholder(na), 7, *placeholder(nb), 8, 9], [0, 1], na + nb + 6),
        ([*placeholder(nb), *placeholder(nb), 10, 11, 12], [1, 1], 2 * nb + 5),
    ]
    inputs = [SequenceInput(tokens=t, prompt_len=p, images=tuple(r)) for t, r, p in seqs]
    return ScoreRequest(inputs, temperature=1.3, images=Images((A, B))), seqs


def _count_tower(ex: StatelessExecutor, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of images of each vision-tower call of ``ex``'s reference model, as made."""
    backbone = ex.reference_model.model
    calls: list[int] = []
    tower = backbone.get_image_features

    def counted(pixels: Any, grids: Any, **kw: Any) -> Any:
        calls.append(len(grids))
        return tower(pixels, grids, **kw)

    monkeypatch.setattr(backbone, "get_image_features", counted)
    return calls


def _max_error(ex: StatelessExecutor) -> float:
    """The largest |log-prob - transformers' own| over ``_job``'s scored tokens."""
    request, seqs = _job(ex)
    out = ex.run([ex.prepare(request)])
    worst = 0.0
    for (tokens, refs, p), score in zip(seqs, out.scores, strict=True):
        want = reference(ex.reference_model, _processor(ex), [A, B], tokens, refs, temperature=1.3)
        worst = max(worst, float(np.abs(score.logps - want["logps"][p - 1 :]).max()))
    return worst


def test_the_image_path_equals_each_sequence_alone(vlm: StatelessExecutor) -> None:
    assert _max_error(vlm) < 2e-5


def test_positions_not_passed_is_caught(
    vlm: StatelessExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trap: without explicit positions the model silently uses 1-D ones. Reintroduced
    (the forward drops ``position_ids``), the comparison above fails by far more than 2e-5."""
    hidden = forward_module.backbone_hidden

    def dropped(model: Any, batch: Any, **extra: Any) -> torch.Tensor:
        return hidden(model, replace(batch, position_ids=None), **extra)

    monkeypatch.setattr(forward_module, "backbone_hidden", dropped)
    assert _max_error(vlm) > 1e-3


def test_one_dimensional_positions_are_caught(
    vlm: StatelessExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model's text fallback (0 .. L-1 in every row) instead of its mRoPE rule fails too."""
    laid = layout_module.vision_layout

    def flat(batch: Any, ordered: Any, token: int, **kw: Any) -> Any:
        batch = laid(batch, ordered, token, **kw)
        rows, width = batch.input_ids.shape
        return replace(batch, position_ids=torch.arange(width).expand(3, rows, width))

    monkeypatch.setattr(layout_module, "vision_layout", flat)
    assert _max_error(vlm) > 1e-3


def test_qwen3_vl_deepstack_features_misplaced_or_dropped_are_caught(
    vlm: StatelessExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3-VL's tower gives deepstack features per image beside the main ones: dropped (the
    model then adds nothing at the early layers: zeros) or one image's given to every image,
    the comparison fails."""
    vlm_rule = vision_model(vlm.reference_model)
    assert vlm_rule is not None
    if vlm_rule.kind not in DEEPSTACK:
        assert not hasattr(vlm.reference_model.model.visual, "deepstack_merger_list")
        return
    placed = type(vlm_rule).placed

    def dropped(self: Any, feats: Any) -> Any:
        out = placed(self, feats)
        zero = [tuple(torch.zeros_like(x) for x in layer) for layer in out.deepstack_features]
        return replace(out, deepstack_features=zero)

    def first_only(self: Any, feats: Any) -> Any:
        out = placed(self, feats)  # every image given the first image's deepstack features
        deep = [tuple(layer[0] for _ in layer) for layer in out.deepstack_features]
        return replace(out, deepstack_features=deep)

    assert _max_error(vlm) < 2e-5
    for wrong in (dropped, first_only):
        with monkeypatch.context() as patch:
            patch.setattr(type(vlm_rule), "placed", wrong)
            assert _max_error(vlm) > 1e-3


def test_the_vision_tower_runs_once_per_distinct_image_and_never_for_text(
    vlm: StatelessExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_tower(vlm, monkeypatch)
    request, _ = _job(vlm)
    out = vlm.run([vlm.prepare(request)])
    # A and B, shown five times over the call's forwards: each through the tower once
    assert sum(calls) == 2 and out.metrics.vision_images == 2
    text = ScoreRequest([SequenceInput(tokens=[1, 2, 3, 4], prompt_len=2)])
    out = vlm.run([vlm.prepare(text)])
    assert sum(calls) == 2 and out.metrics.vision_images == 0


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_image_sharing_off_runs_the_tower_per_image_of_each_sequence(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``image_sharing="off"`` (``serve --image-sharing off``): the tower runs once per image
    of every sequence (A, A B, B B: five), the scores the same as with sharing on; ``info``
    says which."""
    path = save_tiny_vlm(tmp_path, arch, seed=5)
    ex = StatelessExecutor.from_pretrained(
        ExecutorConfig(dtype="float32", image_sharing="off"), str(path)
    )
    calls = _count_tower(ex, monkeypatch)
    try:
        assert ex.info["vision"]["image_sharing"] == "off"
        request, _ = _job(ex)
        out = ex.run([ex.prepare(request)])
        assert sum(calls) == 5 and out.metrics.vision_images == 5
        assert _max_error(ex) < 2e-5
    finally:
        ex.close()
    with pytest.raises(ConfigError, match="image_sharing"):
        ExecutorConfig(image_sharing="sometimes")  # type: ignore[arg-type]


def test_a_short_run_in_one_sequence_is_refused_though_the_batch_totals_match(
    vlm: StatelessExecutor,
) -> None:
    """One run one token short and another one long: the model's own check (batch totals)
    would pass; ours names the sequence, the image and both counts."""
    n = image_tokens(_processor(vlm), A)
    short = SequenceInput(tokens=[1, *placeholder(n - 1), 2, 3], prompt_len=n + 2, images=(0,))
    long = SequenceInput(tokens=[1, *placeholder(n + 1), 2, 3], prompt_len=n + 4, images=(0,))
    with pytest.raises(BadRequest) as err:
        vlm.prepare(ScoreRequest([long, short], images=Images((A,))))
    assert err.value.message.startswith(f"sequence 0: image run 0 (images[0]) has {n + 1}")
    assert f"makes {n}" in err.value.message
    with pytest.raises(BadRequest, match="sequence 0: 2 runs of the image token but 1 images"):
        two = [1, *placeholder(n), *placeholder(n), 2]
        vlm.prepare(ScoreRequest([SequenceInput(two, 1, images=(0,))], images=Images((A,))))


def test_the_processor_runs_once_per_image_and_options(vlm: StatelessExecutor) -> None:
    c = _processor(vlm)
    seq = SequenceInput([1, *placeholder(image_tokens(c, A)), 2], 1, images=(0,))
    request = ScoreRequest([seq], images=Images((A,)))
    first = vlm.prepare(request).plan[0]
    again = vlm.prepare(request).plan[0]
    assert (again.images_decoded, again.cache_hits) == (1, 1)
    assert (first.images_decoded, first.cache_hits) == (1, 0) or first.cache_hits == 1
    big = {"min_pixels": 28 * 28 * 16, "max_pixels": 28 * 28 * 16}
    n = image_tokens(c, A, **big)
    assert n != image_tokens(c, A)
    seq = SequenceInput([1, *placeholder(n), 2], 1, images=(0,))
    vlm.prepare(ScoreRequest([seq], images=Images((A,), big)))  # counts under the options
    with pytest.raises(BadRequest, match="image run 0"):
        vlm.prepare(ScoreRequest([seq], images=Images((A,))))


def test_placeholders_in_a_completion_are_never_scored(vlm: StatelessExecutor) -> None:
    n = image_tokens(_processor(vlm), A)
    tokens = [1, 2, *placeholder(n), 3, 4]
    out = vlm.run([vlm.prepare(ScoreRequest([SequenceInput(tokens, 2, images=(0,))],
                                            images=Images((A,))))])  # fmt: skip
    scored = [t for t in range(2, len(tokens)) if tokens[t] != IMAGE]
    want = reference(vlm.reference_model, _processor(vlm), [A], tokens, [0])["logps"]
    np.testing.assert_allclose(out.scores[0].logps, want[np.array(scored) - 1], atol=2e-5)


def test_video_and_text_only_refusals(vlm: StatelessExecutor) -> None:
    with pytest.raises(BadRequest, match="video"):
        vlm.prepare(ScoreRequest([SequenceInput([1, VIDEO, 2], 1)]))
    text = StatelessExecutor(ExecutorConfig(dtype="float32"), tiny_causal())
    with pytest.raises(BadRequest, match="text-only model"):
        n = image_tokens(_processor(vlm), A)
        text.prepare(ScoreRequest([SequenceInput([1, *placeholder(n)], 1, images=(0,))],
                                  images=Images((A,))))  # fmt: skip
    assert "vision" in vlm.info and "vision" not in text.info


@pytest.mark.parametrize(
    "config, name",
    [
        (PaliGemmaConfig, "PaliGemmaForConditionalGeneration"),
        (Idefics2Config, "Idefics2ForConditionalGeneration"),
        (InternVLConfig, "InternVLForConditionalGeneration"),
    ],
)
def test_other_image_text_models_are_refused_naming_the_class(config: Any, name: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name} is an image-text model this worker"):
        served_class(config())


def test_the_load_check_refuses_an_image_path_that_disagrees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, processor = tiny_vlm("qwen2_5_vl", seed=7)
    StatelessExecutor(ExecutorConfig(dtype="float32"), model, image_processor=processor).close()
    laid = layout_module.vision_layout

    def flat(batch: Any, ordered: Any, token: int, **kw: Any) -> Any:  # the 1-D fallback
        batch = laid(batch, ordered, token, **kw)
        rows, width = batch.input_ids.shape
        return replace(batch, position_ids=torch.arange(width).expand(3, rows, width))

    monkeypatch.setattr(layout_module, "vision_layout", flat)
    with pytest.raises(ConfigError, match="the image path disagrees with the model's own"):
        StatelessExecutor(ExecutorConfig(dtype="float32"), model, image_processor=processor)


def test_the_processor_cache_is_bounded_in_bytes() -> None:
    model, processor = tiny_vlm("qwen2_vl")
    rule = vision_model(model)
    assert rule is not None
    processing = ImageProcessing(processor, rule, cache_bytes=1)
    one = decode_image(A, 0, max_pixels=10**6)
    other = decode_image(B, 1, max_pixels=10**6)
    assert processing.process(one, ())[1] is False
    assert processing.process(one, ())[1] is True
    processing.process(other, ())  # over the byte budget: the older image goes
    assert processing.process(one, ())[1] is False


def test_a_served_checkpoint_without_its_processor_is_refused() -> None:
    model, _ = tiny_vlm("qwen2_vl")
    with pytest.raises(ConfigError, match="needs its image processor"):
        StatelessExecutor(ExecutorConfig(dtype="float32"), model)


@pytest.mark.parametrize(
    "data, why",
    [
        (b"GIF89a" + b"\0" * 40, "not a PNG, JPEG or WebP"),
        (image_file(20, 20, fmt="BMP"), "not a PNG, JPEG or WebP"),
        (image_file(20, 20)[:-40], "does not decode"),
        (image_file(64, 64), "over the worker's limit of 1000"),
    ],
    ids=["gif", "bmp", "truncated", "over-limit"],
)
def test_bad_files_are_bad_requests(data: bytes, why: str) -> None:
    with pytest.raises(BadRequest, match=why):
        decode_image(data, 0, max_pixels=1000)
    assert decode_image(B, 1, max_pixels=10**6).format == "WEBP"
