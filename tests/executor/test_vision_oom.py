"""A device OOM on a batch of image sequences: the batch is split between sequences (packed rows,
padded buckets) or between a tree row's continuations, never inside an image (an image's runs,
SmolVLM's tiles or Mistral-3's rows, stay in one forward with their features), and every
result equals the one of the same call without an OOM (each sequence alone within 2e-5)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.support.vision import IMAGE, image_file
from tests.support.vision_more import more_reference, placeholder, tiny_more_vlm
from worker.executor import ExecutorConfig, StatelessExecutor
from worker.request import Images, ScoreRequest, SequenceInput

A, B = image_file(90, 60, seed=1), image_file(50, 100, seed=2, fmt="WEBP")


def _oom_above(model: Any, cap: int) -> list[tuple[int, int]]:
    """The backbone raises ``torch.OutOfMemoryError`` on forwards of more than ``cap`` slots
    (rows x tokens); returns (slots, image tokens) of every forward that ran."""
    backbone = model.model
    original = backbone.forward
    ran: list[tuple[int, int]] = []

    def forward(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs["input_ids"]
        if ids.numel() > cap:
            raise torch.OutOfMemoryError(f"simulated: {ids.numel()} slots over {cap}")
        ran.append((ids.numel(), int((ids == IMAGE).sum())))
        return original(*args, **kwargs)

    backbone.forward = forward
    return ran


def _seqs(model: Any, processor: Any) -> list[tuple[list[int], list[int], int]]:
    """A GRPO group of four sharing a prompt with image A (one completion showing B), a prompt
    with B, a text-only sequence: (tokens, refs, prompt_len)."""
    pa, pb = (placeholder(model, processor, f) for f in (A, B))
    prompt = [1, 2, *pa, 3, 4, 5]
    return [
        ([*prompt, 6, 7, 8], [0], len(prompt)),
        ([*prompt, 9, 10], [0], len(prompt)),
        ([*prompt, 11, *pb, 12, 13], [0, 1], len(prompt)),
        ([*prompt, 14, 15, 16, 17], [0], len(prompt)),
        ([1, 2, *pb, 3, 4, 5, 6, 7], [1], len(pb) + 5),
        ([7, 8, 9, 10, 11, 12], [], 2),
    ]


def _run(ex: StatelessExecutor, seqs: list[tuple[list[int], list[int], int]]) -> Any:
    inputs = [SequenceInput(tokens=t, prompt_len=p, images=tuple(r)) for t, r, p in seqs]
    return ex.run([ex.prepare(ScoreRequest(inputs, images=Images((A, B))))])


@pytest.mark.parametrize("arch", ["smolvlm_split", "mistral3", "llava_next"])
@pytest.mark.parametrize(
    "packing,sharing", [("packed", "off"), ("padded", "off"), ("packed", "auto")]
)
def test_an_oom_splits_image_batches_between_sequences_and_stays_exact(
    arch: str, packing: str, sharing: str
) -> None:
    model, processor = tiny_more_vlm(arch, seed=4)
    config = ExecutorConfig(
        dtype="float32", packing=packing, prefix_sharing=sharing, min_shared_tokens=4
    )
    ex = StatelessExecutor(config, model, image_processor=processor)
    try:
        seqs = _seqs(model, processor)
        clean = _run(ex, seqs)
        longest = max(len(t) for t, _, _ in seqs)
        cap = longest + 5  # every sequence fits alone, the tree row of the whole group does not
        ran = _oom_above(model, cap)
        out = _run(ex, seqs)
    finally:
        vars(model.model).pop("forward", None)  # the class's own forward again
        ex.close()
    assert out.metrics.oom_splits >= 1 and all(n <= cap for n, _ in ran)
    na, nb = (placeholder(model, processor, f).count(IMAGE) for f in (A, B))
    whole = {i * na + j * nb for i in range(8) for j in range(8)}
    assert all(n in whole for _, n in ran), ran  # each forward's images whole
    if sharing == "auto":  # the group's tree split between its continuations, the image kept
        assert any(s.shared_tokens >= seqs[0][2] for s in out.scores), out.scores
        assert clean.scores[0].shared_tokens == seqs[0][2]
    for (tokens, refs, p), a, b in zip(seqs, out.scores, clean.scores, strict=True):
        assert a.error is None and a.logps is not None and b.logps is not None
        want = more_reference(model, processor, [A, B], tokens, refs)["logps"]
        at = np.array([t - 1 for t in range(p, len(tokens)) if tokens[t] != IMAGE])
        assert float(np.abs(a.logps - want[at]).max()) < 2e-5
        assert float(np.abs(a.logps - b.logps).max()) < 2e-5
