"""The load check of the image path, on the executor's device and dtype (tolerance as the text
probe's).

``image_check``: one probe image scored in a padded batch (beside a text-only sequence of
another length, so the bucket pads) against the model's own forward of the image sequence
alone (``reference_inputs``: its ``pixel_values`` as the processor batches them,
``VisionModel.model_inputs``; Qwen's ``image_grid_thw``, LLaVA-NeXT's and Mistral-3's
``image_sizes``; ``mm_token_type_ids`` and positions by ``get_rope_index``; Gemma-3's
``token_type_ids``, as its processor makes them). A disagreement refuses to start: images are
never scored approximately.

``layout_check``: a GRPO-like probe (two sequences sharing a prompt with an image, one with
another image, one text-only) in packed rows, unmasked buckets and tree rows against each
sequence alone in the checked padded path. A layout that disagrees (or cannot run) is not used
for image sequences, with its reason (``ImageLayouts``, in the results' ``info``); they run
padded. Gemma-3's image blocks attend bidirectionally (``token_type_ids``), which tree
attention does not reproduce: its image sequences never run in tree rows.

``reward_check``: a reward model of its own with images (``Gemma3ForSequenceClassification``, a
VLM read through a value head) scores the probe in a padded batch against its own backbone's
forward of the sequence alone with its processor's output, pooled by the same head at the last
token; then the layouts of its image sequences as ``layout_check``'s, rewards compared. A
reward read from the reference model's own hidden states (one model) shares the reference's
checks and layouts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from worker.errors import ConfigError
from worker.executor.forward import BatchForward
from worker.executor.packing import pad
from worker.executor.rewards.pooling import HiddenStateRewardAdapter, backbone_of
from worker.executor.tree.check import kernel_for
from worker.executor.vision.arch import VisionModel
from worker.executor.vision.decode import Decoded
from worker.executor.vision.intake import (
    RewardImages,
    VisionIntake,
    check_sequence,
    reward_images,
    rope_positions,
    vision_intake,
)
from worker.executor.vision.layout import ImageLayouts, image_share_groups
from worker.executor.vision.processor import ProcessedImage
from worker.modes import Mode
from worker.scorer.inputs import PreparedSequence
from worker.scorer.outputs import SequenceScore


def probe_image(width: int = 84, height: int = 56) -> Decoded:
    """A ``width x height`` RGB gradient (never read from a file)."""
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 3, y * 4, (x + y) * 2], axis=-1).astype("uint8")  # [H, W, 3]
    digest = f"selfcheck-probe-{width}x{height}"
    return Decoded(image=Image.fromarray(pixels), digest=digest, format="PNG")


def reference_inputs(
    vlm: VisionModel, ids: np.ndarray, images: list[ProcessedImage], device: torch.device
) -> dict[str, torch.Tensor]:
    """The inputs of the model's own forward of ``ids`` alone with ``images`` (its processor's
    output), as transformers' processor and model documentation give them."""
    input_ids = torch.from_numpy(ids)[None].to(device)  # [1, L]
    positions = torch.from_numpy(rope_positions(vlm, ids, images)).to(device)  # [3, L] or [L]
    pixels = {k: v.to(device) for k, v in vlm.model_inputs(images).items()}
    out = {"input_ids": input_ids, **pixels}
    if vlm.mrope:
        out["position_ids"] = positions[:, None]  # [3, 1, L]
        out["mm_token_type_ids"] = (input_ids == vlm.image_token).int()
    else:
        out["position_ids"] = positions[None]  # [1, L]
    if vlm.token_types:
        out["token_type_ids"] = (input_ids == vlm.image_token).long()
    return out


def image_check(forward: BatchForward, intake: VisionIntake) -> None:
    """``ConfigError`` unless the image path gives the model's own log-probs (module docstring)."""
    model, vlm = forward.reference_model, intake.model
    processed, _ = intake.processing.process(probe_image(), ())
    ids = np.array([3, 4, *_placeholder(vlm, processed), 6, 7, 8], dtype=np.int64)  # [L]
    scored = np.arange(len(ids) - 4, len(ids), dtype=np.int64)
    seq = check_sequence(PreparedSequence(ids, scored), [0], [processed], vlm, 0)
    text = PreparedSequence(np.arange(1, 6, dtype=np.int64), np.arange(2, 5, dtype=np.int64))
    got = forward.compute([seq, text], [0, 1], "reference", 1.0, layout="padded", row_tokens=0)
    device = forward.device
    inputs = reference_inputs(vlm, ids, [processed], device)
    input_ids = inputs["input_ids"]
    with torch.inference_mode():
        logits = model(**inputs, use_cache=False).logits[0].float()  # [L, V]
    want = logits.log_softmax(-1)[scored - 1].gather(-1, input_ids[0, scored, None])[:, 0]
    tol = 1e-3 if next(model.parameters()).dtype == torch.float32 else 0.25
    have = got.scores[0].logps
    worst = float(np.abs(have - want.cpu().numpy()).max()) if have is not None else np.inf
    if not worst <= tol:
        raise ConfigError(
            f"{vlm.name}: the image path disagrees with the model's own forward by {worst:.3g} "
            f"(tolerance {tol}); images would be scored wrong, so the worker does not start"
        )


def _placeholder(vlm: VisionModel, image: ProcessedImage) -> list[int]:
    """The image's runs of the image token, a text token after each."""
    return [t for n in image.runs for t in [*[vlm.image_token] * n, 5]]


def probe_layout_sequences(intake: VisionIntake) -> list[PreparedSequence]:
    """Two sequences sharing a prompt with the probe image, one showing another image, one
    text-only (every completion position scored)."""
    vlm = intake.model
    first, _ = intake.processing.process(probe_image(), ())
    second, _ = intake.processing.process(probe_image(56, 84), ())
    prompt = [3, 4, *_placeholder(vlm, first), 6]
    rows = [
        ([*prompt, 7, 8, 9], [first]),
        ([*prompt, 10, 11], [first]),
        ([12, *_placeholder(vlm, second), 13, 14, 15], [second]),
        ([16, 17, 18, 19, 20, 21], []),
    ]
    out = []
    for i, (tokens, shown) in enumerate(rows):
        ids = np.array(tokens, dtype=np.int64)
        seq = PreparedSequence(ids, np.arange(1, len(ids), dtype=np.int64))
        out.append(check_sequence(seq, list(range(len(shown))), shown, vlm, i))
    return out


def layout_check(
    forward: BatchForward,
    intake: VisionIntake,
    *,
    packed: bool,
    unmasked: bool,
    sharing: bool,
    backend: str,
    mode: Mode = "reference",
) -> ImageLayouts:
    """Which of packed rows, unmasked buckets and tree rows image sequences may run in (module
    docstring): ``packed`` / ``unmasked`` / ``sharing``: whether the text path runs them;
    ``mode``: ``reward`` for a reward model's own image sequences (rewards compared)."""
    vlm = intake.model
    seqs = probe_layout_sequences(intake)
    alone = [
        forward.compute([s], [i], mode, 1.0, layout="padded", row_tokens=0).scores[0]
        for i, s in enumerate(seqs)
    ]
    model = forward.reward_model if mode == "reward" else forward.reference_model
    tol = 1e-3 if next(model.parameters()).dtype == torch.float32 else 0.25
    why: dict[str, str] = {}

    def agrees(name: str, run: Callable[[], list[SequenceScore]]) -> bool:
        try:
            got = run()
        except Exception as exc:  # a layout that cannot run image sequences is not used
            why[name] = f"{type(exc).__name__}: {exc}"[:300]
            return False
        worst = max(_gap(a, b, mode) for a, b in zip(got, alone, strict=True))
        if not worst <= tol:
            why[name] = f"disagrees with each sequence alone by {worst:.3g} (tolerance {tol})"
            return False
        return True

    ids = list(range(len(seqs)))
    total = sum(len(s.ids) for s in seqs)

    def laid(layout: Any, row_tokens: int) -> Callable[[], list[SequenceScore]]:
        return lambda: (
            forward.compute(list(seqs), ids, mode, 1.0, layout=layout, row_tokens=row_tokens).scores
        )

    pack_ok = packed and agrees("packed", laid("packed", total))
    if not packed:
        why["packed"] = "packed rows are off for this model"
    bucket_ok = unmasked and agrees("unmasked", laid("unmasked", 0))
    if not unmasked:
        why["unmasked"] = "unmasked buckets are off for this model"
    tree_ok = False
    if not sharing:
        why["tree"] = "prefix sharing is off"
    elif vlm.token_types:
        why["tree"] = (
            f"{vlm.name}: image blocks attend bidirectionally (token_type_ids), which tree "
            "attention does not reproduce"
        )
    else:
        groups = image_share_groups(seqs, 1, vlm.image_token)
        tree_ok = agrees("tree", lambda: _tree_scores(forward, seqs, groups, backend, mode))
    return ImageLayouts(
        packed=pack_ok, unmasked=bucket_ok, tree=tree_ok, image_token=vlm.image_token, why=why
    )


def _tree_scores(
    forward: BatchForward,
    seqs: list[PreparedSequence],
    groups: list[Any],
    backend: str,
    mode: Mode = "reference",
) -> list[SequenceScore]:
    """Every sequence of ``seqs`` scored: the members of ``groups`` in one tree forward, the
    rest alone; in the order of ``seqs``."""
    if not groups:
        raise RuntimeError("the probe's shared image prompt formed no tree")
    members = [i for g in groups for i in g.members]
    got = forward.compute_tree(
        list(seqs), list(range(len(seqs))), groups, mode, 1.0, kernel=kernel_for(backend)
    )
    out = list(got.scores)
    for i, seq in enumerate(seqs):
        if i not in members:
            alone = forward.compute([seq], [i], mode, 1.0, layout="padded", row_tokens=0)
            out[i] = alone.scores[0]
    return out


def _gap(a: SequenceScore, b: SequenceScore, mode: Mode = "reference") -> float:
    """The largest log-prob (``mode`` ``reward``: reward) difference of two scores of one
    sequence (inf when one is missing)."""
    if mode == "reward":
        if a.reward is None or b.reward is None:
            return float("inf")
        return abs(a.reward - b.reward)
    if a.logps is None or b.logps is None or a.logps.shape != b.logps.shape:
        return float("inf")
    return float(np.abs(a.logps - b.logps).max()) if a.logps.size else 0.0


def _unchecked(intake: VisionIntake) -> ImageLayouts:
    """Image sequences padded only: the layouts were not checked (``self_check`` off)."""
    return ImageLayouts(
        image_token=intake.model.image_token,
        why={k: "not checked (self_check off)" for k in ("packed", "unmasked", "tree")},
    )


def checked_intake(
    forward: BatchForward,
    processor: object,
    config: object,
    *,
    packed: bool = False,
    unmasked: bool = False,
    sharing: bool = False,
    backend: str = "sdpa",
) -> tuple[VisionIntake | None, ImageLayouts]:
    """``intake.vision_intake`` of the forward's reference model (``None`` for a text-only
    model), its image path checked at load (``image_check``) and the layouts image sequences
    may run in (``layout_check``; both off when ``config.self_check`` is off)."""
    intake = vision_intake(forward.reference_model, processor, config)
    if intake is None:
        return None, ImageLayouts()
    if not getattr(config, "self_check", True):
        return intake, _unchecked(intake)
    image_check(forward, intake)
    return intake, layout_check(
        forward, intake, packed=packed, unmasked=unmasked, sharing=sharing, backend=backend
    )


def checked_reward(
    forward: BatchForward,
    reference: VisionIntake | None,
    processor: object,
    config: object,
    **text_layouts: Any,
) -> tuple[RewardImages, ImageLayouts | None]:
    """How the forward's reward model takes images (``intake.RewardImages``) and the layouts of
    its image sequences (``None``: the reference's): the ``reference`` intake when one model
    serves both through a hidden-state adapter, else its own with ``processor``, checked
    (``reward_check``; ``text_layouts``: its ``packed`` / ``unmasked`` / ``sharing`` /
    ``backend``)."""
    model, adapter = forward.reward_model, forward.reward_adapter
    shared = model is not None and model is forward.reference_model
    if shared and isinstance(adapter, HiddenStateRewardAdapter):
        return RewardImages(reference, shared=True), None
    reward = reward_images(model, adapter, processor, config)
    if reward.intake is None:
        return reward, None
    return reward, reward_check(forward, reward, config, **text_layouts)


def reward_check(
    forward: BatchForward,
    reward: RewardImages,
    config: object,
    *,
    packed: bool = False,
    unmasked: bool = False,
    sharing: bool = False,
    backend: str = "sdpa",
) -> ImageLayouts:
    """The layouts of the reward model's image sequences (``layout_check`` in ``reward`` mode,
    after its image path is checked at load: module docstring); ``ConfigError`` when it
    disagrees with the model's own forward."""
    intake = reward.intake
    if intake is None:
        return ImageLayouts()
    if not getattr(config, "self_check", True):
        return _unchecked(intake)
    model, vlm, adapter = forward.reward_model, intake.model, forward.reward_adapter
    processed, _ = intake.processing.process(probe_image(), ())
    ids = np.array([3, 4, *_placeholder(vlm, processed), 6, 7, 8], dtype=np.int64)  # [L]
    seq = check_sequence(PreparedSequence(ids, None), [0], [processed], vlm, 0)
    text = PreparedSequence(np.arange(1, 6, dtype=np.int64), None)
    got = forward.compute([seq, text], [0, 1], "reward", 1.0, layout="padded", row_tokens=0)
    inputs = reference_inputs(vlm, ids, [processed], forward.device)
    with torch.inference_mode():
        hidden = backbone_of(model)(**inputs, use_cache=False).last_hidden_state  # [1, L, H]
        alone = pad([ids], [0]).to(forward.device)
        want = float(adapter.from_hidden(model, alone, hidden).rewards[0])  # type: ignore[union-attr]
    tol = 1e-3 if next(model.parameters()).dtype == torch.float32 else 0.25
    have = got.scores[0].reward
    worst = abs(have - want) if have is not None else float("inf")
    if not worst <= tol:
        raise ConfigError(
            f"{vlm.name}: the reward model's image path disagrees with its own forward by "
            f"{worst:.3g} (tolerance {tol}); rewards would be wrong, so the worker does not start"
        )
    return layout_check(
        forward, intake, packed=packed, unmasked=unmasked, sharing=sharing, backend=backend,
        mode="reward",
    )  # fmt: skip
