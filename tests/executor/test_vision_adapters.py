"""Per-job LoRA adapters on a vision-language model with images: a job naming an adapter equals
transformers' forward of the adapted model alone (PEFT's merged weights, the vision tower
adapted too where the adapter targets it), in packed rows and tree rows; a job without one
equals the base (no vision-tower features carried over from the adapted job)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.adapters import save_lora
from tests.support.vision import IMAGE, image_file
from tests.support.vision_more import more_reference, placeholder, save_more_vlm, tiny_more_vlm
from worker.executor import ExecutorConfig, StatelessExecutor
from worker.executor.weights.residency import WeightsConfig
from worker.request import Images, ScoreOptions, ScoreRequest, SequenceInput

A, B = image_file(90, 60, seed=1), image_file(50, 100, seed=2, fmt="WEBP")
# the language model's projections and the vision tower's (CLIP / Pixtral: q_proj, v_proj too;
# CLIP's out_proj, Pixtral's o_proj)
TARGETS = ("q_proj", "v_proj", "o_proj", "out_proj", "down_proj")


@pytest.fixture(scope="module", params=["llava_next", "mistral3", "smolvlm_split"])
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp(request.param)
    path = save_more_vlm(root / "base", request.param, seed=4)
    model, processor = tiny_more_vlm(request.param, seed=4)
    save_lora(model, root / "adapters" / "step-1", seed=7, targets=TARGETS)
    return path, root / "adapters", model, processor


def _adapted(model: Any, adapter: Path) -> Any:
    """The base with the adapter merged by PEFT (``merge_and_unload``)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(model), str(adapter)).merge_and_unload().eval()


def _seqs(model: Any, processor: Any) -> list[tuple[list[int], list[int], int]]:
    pa, pb = (placeholder(model, processor, f) for f in (A, B))
    prompt = [1, 2, *pa, 3, 4, 5]
    return [
        ([*prompt, 6, 7, 8], [0], len(prompt)),
        ([*prompt, 9, 10, 11], [0], len(prompt)),
        ([*prompt, 11, *pb, 12, 13], [0, 1], len(prompt)),
        ([7, 8, 9, 10, 11, 12], [], 2),
    ]


@pytest.mark.parametrize("packing", ["packed", "padded"])
def test_an_adapter_job_with_images_equals_the_adapted_model_alone(
    fleet: Any, packing: str
) -> None:
    path, adapters, model, processor = fleet
    config = ExecutorConfig(dtype="float32", packing=packing, min_shared_tokens=4)
    ex = StatelessExecutor.from_pretrained(
        config, str(path), weights=WeightsConfig(adapter_root=str(adapters))
    )
    seqs = _seqs(model, processor)
    inputs = [SequenceInput(tokens=t, prompt_len=p, images=tuple(r)) for t, r, p in seqs]
    try:
        runs = {  # the adapter's job, then the base's: no vision-tower features carried over
            name: ex.run([ex.prepare(ScoreRequest(inputs, images=Images((A, B)), options=opts))])
            for name, opts in (("step-1", ScoreOptions(adapter="step-1")), ("", ScoreOptions()))
        }
    finally:
        ex.close()
    from safetensors import safe_open

    with safe_open(str(adapters / "step-1" / "adapter_model.safetensors"), "pt") as fh:
        assert any("vision" in k for k in fh.keys())  # noqa: SIM118 (the tower is adapted)
    adapted = _adapted(model, adapters / "step-1")
    assert runs["step-1"].metrics.weights.adapter == "step-1"
    assert runs["step-1"].scores[0].shared_tokens == seqs[0][2]  # the group's tree ran
    for name, reference in (("step-1", adapted), ("", model)):
        for (tokens, refs, p), score in zip(seqs, runs[name].scores, strict=True):
            want = more_reference(reference, processor, [A, B], tokens, refs)["logps"]
            at = np.array([t - 1 for t in range(p, len(tokens)) if tokens[t] != IMAGE])
            assert float(np.abs(score.logps - want[at]).max()) < 2e-5, name
    a, b = runs["step-1"].scores[0].logps, runs[""].scores[0].logps
    assert float(np.abs(a - b).max()) > 1e-2  # the adapter really changes the scores
