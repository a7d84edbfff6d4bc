"""The executor's image path in process for the fixed-count models (tiny LLaVA, Gemma-3, SmolVLM,
Idefics3): each sequence equals transformers' own forward of it alone; Gemma-3's trap
(``token_type_ids`` not passed: image tokens run causally, no error) fails a test when reintroduced;
the vision tower runs once per distinct image; a run that does not match its image's count is
refused naming the sequence, the image and both counts; Gemma-3's pan-and-scan and any job
option are refused (SmolVLM's and Idefics3's image splitting is served:
``tests/executor/test_vision_more.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.models import tiny_reward
from tests.support.vision import image_file
from tests.support.vision_fixed import fixed_placeholder, fixed_reference, image_count
from worker.demo.tiny import FIXED_VLM_ARCHS, random_model, save_tiny_vlm, tiny_fixed_vlm
from worker.errors import BadRequest, ConfigError
from worker.executor import ExecutorConfig, StatelessExecutor
from worker.executor.vision import features
from worker.request import Images, ScoreRequest, SequenceInput

A, B = image_file(90, 60, seed=1), image_file(50, 100, seed=2, fmt="WEBP")


@pytest.fixture(scope="module", params=FIXED_VLM_ARCHS)
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    path: Path = save_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param, seed=5)
    ex = StatelessExecutor.from_pretrained(ExecutorConfig(dtype="float32"), str(path))
    yield ex
    ex.close()


def _processor(ex: StatelessExecutor) -> Any:
    assert ex._vision is not None
    return ex._vision.processing.processor


def _job(ex: StatelessExecutor) -> tuple[ScoreRequest, list[tuple[list[int], list[int], int]]]:
    """Three sequences showing A, A then B, and B twice, and a text-only one."""
    model, proc = ex.reference_model, _processor(ex)
    pa = fixed_placeholder(model, image_count(model, proc, A))
    pb = fixed_placeholder(model, image_count(model, proc, B))
    seqs = [
        ([1, 2, *pa, 3, 4, 5], [0], len(pa) + 3),
        ([6, *pa, 7, *pb, 8, 9], [0, 1], len(pa) + len(pb) + 2),
        ([5, *pb, 6, *pb, 10, 11, 12], [1, 1], 2 * len(pb) + 3),
        ([7, 8, 9, 10], [], 2),
    ]
    inputs = [SequenceInput(tokens=t, prompt_len=p, images=tuple(r)) for t, r, p in seqs]
    return ScoreRequest(inputs, temperature=1.3, images=Images((A, B))), seqs


def _max_error(ex: StatelessExecutor, *, token_types: bool = True) -> float:
    """The largest |log-prob - transformers' own| over ``_job``'s scored tokens."""
    request, seqs = _job(ex)
    out = ex.run([ex.prepare(request)])
    worst = 0.0
    for (tokens, refs, p), score in zip(seqs, out.scores, strict=True):
        want = fixed_reference(
            ex.reference_model, _processor(ex), [A, B], tokens, refs, temperature=1.3,
            token_types=token_types,
        )  # fmt: skip
        worst = max(worst, float(np.abs(score.logps - want["logps"][p - 1 :]).max()))
    return worst


def test_the_image_path_equals_each_sequence_alone(vlm: StatelessExecutor) -> None:
    assert _max_error(vlm) < 2e-5


@pytest.mark.parametrize("vlm", ["gemma3"], indirect=True)
def test_gemma3_without_token_type_ids_is_caught(
    vlm: StatelessExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trap: without ``token_type_ids`` Gemma-3 runs image tokens causally, silently.
    The reference with them differs from the one without (the mask really is bidirectional
    within an image), and a forward that drops them fails the comparison."""
    tokens, refs, _ = _job(vlm)[1][0]
    model, proc = vlm.reference_model, _processor(vlm)
    both = fixed_reference(model, proc, [A, B], tokens, refs)["logps"]
    causal = fixed_reference(model, proc, [A, B], tokens, refs, token_types=False)["logps"]
    assert np.abs(both - causal).max() > 1e-3
    monkeypatch.setattr(features, "token_inputs", lambda vlm, input_ids: {})
    assert _max_error(vlm) > 1e-3
    assert _max_error(vlm, token_types=False) < 2e-5  # what was dropped: exactly the types


def test_the_vision_tower_runs_once_per_distinct_image(
    vlm: StatelessExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    backbone = vlm.reference_model.model
    calls: list[int] = []
    tower = backbone.get_image_features

    def counted(pixel_values: Any, *args: Any, **kw: Any) -> Any:
        # SmolVLM's / Idefics3's tiles of every image as one sample: [1, tiles, 3, H, W]
        calls.append(pixel_values.shape[1] if pixel_values.dim() == 5 else len(pixel_values))
        return tower(pixel_values, *args, **kw)

    monkeypatch.setattr(backbone, "get_image_features", counted)
    request, _ = _job(vlm)
    out = vlm.run([vlm.prepare(request)])
    # A and B, shown five times over the call's forwards: each through the tower once
    assert sum(calls) == 2 and out.metrics.vision_images == 2


def test_a_run_that_does_not_match_the_count_is_refused(vlm: StatelessExecutor) -> None:
    model, proc = vlm.reference_model, _processor(vlm)
    n = image_count(model, proc, A)
    good = SequenceInput([1, *fixed_placeholder(model, n), 2, 3], 2, images=(0,))
    short = SequenceInput([1, *fixed_placeholder(model, n - 1), 2, 3], 2, images=(0,))
    request = ScoreRequest([good, short], images=Images((A,)))
    message = f"sequence 1: image run 0 \\(images\\[0\\]\\) has {n - 1} image tokens but the "
    with pytest.raises(BadRequest, match=message + f"processor makes {n} for that image"):
        vlm.prepare(request)


def test_job_options_and_pan_and_scan_are_refused(vlm: StatelessExecutor) -> None:
    model, proc = vlm.reference_model, _processor(vlm)
    seq = SequenceInput([1, *fixed_placeholder(model, image_count(model, proc, A))], 1, images=(0,))
    with pytest.raises(BadRequest, match="takes no job option"):  # Qwen2-VL's sizes only
        vlm.prepare(ScoreRequest([seq], images=Images((A,), {"max_pixels": 9})))
    with pytest.raises(BadRequest, match="'do_pan_and_scan' is not one of"):  # not on the wire
        Images((A,), {"do_pan_and_scan": 1})
    if model.config.model_type == "gemma3":
        model, processor = tiny_fixed_vlm("gemma3")
        processor.do_pan_and_scan = True
        with pytest.raises(ConfigError, match="do_pan_and_scan is not served"):
            StatelessExecutor(ExecutorConfig(dtype="float32"), model, image_processor=processor)


def test_images_for_a_text_reward_model_are_refused_with_the_reason() -> None:
    """A Gemma-3 reference with a text-only reward model: a ``both`` job with images is
    refused, naming the reward model (its reward would ignore the images)."""
    model, processor = tiny_fixed_vlm("gemma3")
    config = ExecutorConfig(dtype="float32", self_check=False)
    ex = StatelessExecutor(config, model, tiny_reward(), image_processor=processor)
    seq = SequenceInput([1, *fixed_placeholder(model, 4)], 1, images=(0,))
    request = ScoreRequest([seq], mode="both", images=Images((A,)))
    why = r"the reward model LlamaForSequenceClassification is text-only: it cannot read"
    with pytest.raises(BadRequest, match=why):
        ex.prepare(request)


def test_llava_keeping_cls_from_two_layers_counts_one_more_token() -> None:
    """``vision_feature_select_strategy`` ``full`` keeps CLS (one more token per image); a list
    of ``vision_feature_layer`` s is concatenated; both equal the model's own forward."""
    model, processor = tiny_fixed_vlm("llava")
    model.config.vision_feature_select_strategy = "full"
    model.config.vision_feature_layer = [-2, -1]
    model = random_model("LlavaForConditionalGeneration", model.config, 4)
    n = image_count(model, processor, A)
    assert n == 17  # 4 x 4 patches and CLS
    ex = StatelessExecutor(ExecutorConfig(dtype="float32"), model, image_processor=processor)
    tokens = [1, 2, *fixed_placeholder(model, n), 3, 4, 5]
    request = ScoreRequest([SequenceInput(tokens, n + 2, images=(0,))], images=Images((A,)))
    got = ex.run([ex.prepare(request)]).scores[0].logps
    want = fixed_reference(model, processor, [A], tokens, [0])["logps"][n + 1 :]
    assert np.abs(got - want).max() < 2e-5
    short = SequenceInput([1, *fixed_placeholder(model, 16), 2], 1, images=(0,))
    with pytest.raises(BadRequest, match="has 16 image tokens but the processor makes 17"):
        ex.prepare(ScoreRequest([short], images=Images((A,))))


def test_an_image_text_reward_model_scores_images_with_its_processor_only() -> None:
    """``Gemma3ForSequenceClassification`` as the reward model scores text; with its image
    processor it scores a job with images, without it the job is ``bad_request`` naming the
    model and the processor it lacks."""
    model, processor = tiny_fixed_vlm("gemma3")
    config = model.config
    config.num_labels, config.pad_token_id, config.text_config.pad_token_id = 1, 0, 0
    reward = random_model("Gemma3ForSequenceClassification", config, 1)
    ex = StatelessExecutor(ExecutorConfig(dtype="float32", mode="reward"), None, reward)
    text = ScoreRequest([SequenceInput([1, 2, 3, 4], 2)], mode="reward")
    assert np.isfinite(ex.run([ex.prepare(text)]).scores[0].reward)
    seq = SequenceInput([1, *fixed_placeholder(model, 4), 2], 1, images=(0,))
    request = ScoreRequest([seq], mode="reward", images=Images((A,)))
    why = "image-text reward model Gemma3ForSequenceClassification: .*image processor"
    with pytest.raises(BadRequest, match=why):
        ex.prepare(request)
    served = StatelessExecutor(
        ExecutorConfig(dtype="float32", mode="reward"), None, reward,
        reward_image_processor=processor,
    )  # fmt: skip
    assert np.isfinite(served.run([served.prepare(request)]).scores[0].reward)
