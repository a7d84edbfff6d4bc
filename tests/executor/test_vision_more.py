"""The executor's image path in process for LLaVA-NeXT, LLaVA-OneVision (anyres: a size-dependent
count, newline features), Mistral-3 (a Pixtral tower: a run per image row, ``image_sizes``) and
SmolVLM / Idefics3 with image splitting on (a run per tile and the global image): each sequence's
log-probs (a mask, a temperature), entropy and top-k equal transformers' own forward of it alone
with its processor's output; features given to the wrong image, or one image's runs given another
image's counts, are caught; the vision tower runs once per distinct image; a run or a count of
runs that does not match its image is refused naming the sequence; other image-text models and
video stay refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.vision import IMAGE, image_file
from tests.support.vision_more import (
    MORE_VLM_ARCHS,
    more_reference,
    placeholder,
    save_more_vlm,
    tiny_more_vlm,
)
from worker.demo.tiny import VLM_TOKENS
from worker.errors import BadRequest
from worker.executor import ExecutorConfig, StatelessExecutor
from worker.executor.vision.arch import VisionModel
from worker.request import Images, ScoreOptions, ScoreRequest, SequenceInput, TokenOutputs

A, B = image_file(90, 60, seed=1), image_file(50, 100, seed=2, fmt="WEBP")
C = image_file(20, 24, seed=3, fmt="JPEG")  # small: other views, rows and tiles than A
FILES = [A, B, C]


@pytest.fixture(scope="module", params=MORE_VLM_ARCHS)
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    path: Path = save_more_vlm(tmp_path_factory.mktemp(request.param), request.param, seed=5)
    ex = StatelessExecutor.from_pretrained(ExecutorConfig(dtype="float32"), str(path))
    yield ex
    ex.close()


def _processor(ex: StatelessExecutor) -> Any:
    assert ex._vision is not None
    return ex._vision.processing.processor


def _job(
    ex: StatelessExecutor,
) -> tuple[list[SequenceInput], list[tuple[list[int], list[int], list[int]]]]:
    """Four sequences showing A; A then B; C, B, C; and text only: (tokens, refs, scored)."""
    model, proc = ex.reference_model, _processor(ex)
    pa, pb, pc = (placeholder(model, proc, f) for f in FILES)
    s0 = [1, 2, *pa, 3, 4, 5]
    s1 = [6, *pa, 7, *pb, 8, 9, 10]
    s2 = [5, *pc, 6, *pb, 7, *pc, 10, 11, 12]
    s3 = [7, 8, 9, 10, 11]
    mask1 = [0] * (len(s1) - 4) + [1, 0, 1, 1]
    seqs = [
        SequenceInput(s0, prompt_len=len(s0) - 3, images=(0,)),
        SequenceInput(s1, mask=mask1, images=(0, 1)),
        SequenceInput(s2, prompt_len=2, images=(2, 1, 2)),  # image tokens in it are not scored
        SequenceInput(s3, prompt_len=2),
    ]
    scored = [
        list(range(len(s0) - 3, len(s0))),
        [t for t, m in enumerate(mask1) if m and s1[t] != IMAGE],  # image tokens never scored
        [t for t in range(2, len(s2)) if s2[t] != IMAGE],
        [2, 3, 4],
    ]
    return seqs, [
        (list(s.tokens), list(s.images or ()), at) for s, at in zip(seqs, scored, strict=True)
    ]


def _max_error(ex: StatelessExecutor, temp: float = 1.3, k: int = 3) -> float:
    """The largest difference of log-probs, entropy and top-k log-probs to transformers' own
    (and top-k ids equal) over ``_job``."""
    seqs, expected = _job(ex)
    spec = TokenOutputs(frozenset({"logps", "entropy", "topk"}), topk=k)
    request = ScoreRequest(
        seqs, temperature=temp, options=ScoreOptions(outputs=spec), images=Images(tuple(FILES))
    )
    out = ex.run([ex.prepare(request)])
    worst = 0.0
    for (tokens, refs, scored), score in zip(expected, out.scores, strict=True):
        want = more_reference(
            ex.reference_model, _processor(ex), FILES, tokens, refs, temperature=temp, topk=k
        )
        at = np.array(scored) - 1  # the position that predicts each scored token
        outputs = score.arrays or {}
        np.testing.assert_array_equal(outputs["topk_ids"], want["topk_ids"][at])
        for have, name in ((score.logps, "logps"), (outputs["entropy"], "entropy")):
            worst = max(worst, float(np.abs(have - want[name][at]).max()))
        worst = max(worst, float(np.abs(outputs["topk_logps"] - want["topk_logps"][at]).max()))
    return worst


def test_the_image_path_equals_each_sequence_alone(vlm: StatelessExecutor) -> None:
    assert _max_error(vlm) < 2e-5


def test_features_given_to_the_wrong_image_are_caught(
    vlm: StatelessExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each image's features in the order its runs appear: reversed within each image (so one
    run, row or tile gets another's features) the comparison fails."""
    placed = VisionModel.placed

    def reversed_runs(self: Any, feats: Any) -> Any:
        return placed(self, [f.flip(0) for f in feats])

    monkeypatch.setattr(VisionModel, "placed", reversed_runs)
    with pytest.raises(AssertionError):
        assert _max_error(vlm) < 1e-3


def test_the_runs_of_an_image_follow_the_processor(vlm: StatelessExecutor) -> None:
    """A (90 x 60) and C (20 x 24) differ in count: per run (Mistral-3's rows, SmolVLM's tiles)
    or per image (anyres), as the model's own processor writes them."""
    assert vlm._vision is not None
    processing = vlm._vision.processing
    from worker.executor.vision.decode import decode_image

    runs = [processing.process(decode_image(f, i, max_pixels=10**6), ())[0].runs
            for i, f in enumerate(FILES)]  # fmt: skip
    kind = vlm.reference_model.config.model_type
    model, proc = vlm.reference_model, _processor(vlm)
    for data, got in zip(FILES, runs, strict=True):
        tokens = placeholder(model, proc, data)
        assert sum(got) == tokens.count(IMAGE)
    if kind in ("smolvlm", "idefics3"):
        assert runs[0] == (4,) * 7  # 3 x 2 tiles and the global image
        assert runs[2] == (4,) * 10  # C upscaled to 84 x 84 by the processor: 3 x 3 tiles
    elif kind == "mistral3":
        assert len(runs[0]) == 3 and set(runs[0]) == {4}  # 3 rows of 4
    else:
        assert len(runs[0]) == 1 and runs[0] != runs[2]


def test_the_vision_tower_runs_once_per_distinct_image(
    vlm: StatelessExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    backbone = vlm.reference_model.model
    calls: list[int] = []
    tower = backbone.get_image_features

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return tower(*args, **kw)

    monkeypatch.setattr(backbone, "get_image_features", counted)
    seqs, _ = _job(vlm)
    out = vlm.run([vlm.prepare(ScoreRequest(seqs, images=Images(tuple(FILES))))])
    # A, B, C shown seven times over the call's forwards: each through the tower once (a
    # forward whose images all ran before calls no tower)
    assert out.metrics.vision_images == 3 and 1 <= len(calls) <= 3


def test_a_count_mismatch_in_one_sequence_is_refused_naming_it(vlm: StatelessExecutor) -> None:
    model, proc = vlm.reference_model, _processor(vlm)
    pa = placeholder(model, proc, A)
    first = pa.index(IMAGE)
    short = [*pa[:first], *pa[first + 1 :]]  # one image token fewer in the image's first run
    good = SequenceInput([1, *pa, 2, 3], 2, images=(0,))
    bad = SequenceInput([1, *short, 2, 3], 2, images=(0,))
    request = ScoreRequest([good, good, bad], images=Images((A,)))
    with pytest.raises(BadRequest, match=r"sequence 2: image run 0 \(images\[0\]") as err:
        vlm.prepare(request)
    message = err.value.message
    n = next(len(r) for r in "".join("x" if t == IMAGE else " " for t in pa).split() if r)
    assert f"has {n - 1} image tokens but the processor makes {n}" in message, message


def test_a_missing_run_of_a_multi_run_image_is_refused(vlm: StatelessExecutor) -> None:
    """Mistral-3's rows and SmolVLM's tiles: an image whose last run is missing is refused with
    the runs its image makes; a one-run model counts images as before."""
    model, proc = vlm.reference_model, _processor(vlm)
    pa = placeholder(model, proc, A)
    cut = len(pa) - 1 - pa[::-1].index(IMAGE)  # the last image token
    start = cut
    while start > 0 and pa[start - 1] == IMAGE:
        start -= 1
    dropped = [t for i, t in enumerate(pa) if not start <= i <= cut]
    runs = "".join("x" if t == IMAGE else " " for t in pa).split()
    bad = SequenceInput([1, *dropped, 2, 3], 2, images=(0,))
    with pytest.raises(BadRequest, match="sequence 0: ") as err:
        vlm.prepare(ScoreRequest([bad], images=Images((A,))))
    message = err.value.message
    if len(runs) > 1:
        want = f"{len(runs) - 1} runs of the image token but 1 images named, which make {len(runs)}"
        assert want in message, message
    else:
        assert "0 runs of the image token but 1 images named" in message, message


def test_video_stays_refused() -> None:
    """LLaVA-OneVision has a video token: a sequence holding it is refused, naming video."""
    model, proc = tiny_more_vlm("llava_onevision")
    ex = StatelessExecutor(
        ExecutorConfig(dtype="float32", self_check=False), model, image_processor=proc
    )
    pa = placeholder(model, proc, A)
    seq = SequenceInput([1, *pa, VLM_TOKENS["video_token_id"], 2], 1, images=(0,))
    with pytest.raises(BadRequest, match="video"):
        ex.prepare(ScoreRequest([seq], images=Images((A,))))


def test_an_image_text_model_not_served_is_refused_naming_its_class() -> None:
    from transformers import PaliGemmaConfig

    from worker.demo.tiny import random_model
    from worker.errors import ConfigError

    config = PaliGemmaConfig(
        text_config={"model_type": "gemma", "vocab_size": 96, "hidden_size": 32,
                     "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": 16},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 28, "patch_size": 7},
    )  # fmt: skip
    model = random_model("PaliGemmaForConditionalGeneration", config, 0)
    with pytest.raises(ConfigError, match="PaliGemmaForConditionalGeneration is an image-text"):
        StatelessExecutor(ExecutorConfig(dtype="float32"), model, image_processor=object())


def test_the_load_check_probes_multi_run_images() -> None:
    """The load check scores a probe image in a padded batch against the model's own forward:
    a tower that gives the wrong image's features refuses to start."""
    from worker.errors import ConfigError

    model, proc = tiny_more_vlm("mistral3", 2)
    StatelessExecutor(ExecutorConfig(dtype="float32"), model, image_processor=proc)  # passes
    original = VisionModel.features

    def shifted(self: Any, pixels: torch.Tensor, grids: torch.Tensor) -> list[Any]:
        return [f.roll(1, 0) for f in original(self, pixels, grids)]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VisionModel, "features", shifted)
        with pytest.raises(ConfigError, match="disagrees with the model's own forward"):
            StatelessExecutor(ExecutorConfig(dtype="float32"), model, image_processor=proc)
