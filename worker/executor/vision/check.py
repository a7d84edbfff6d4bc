"""The load check of the image path: one probe image scored in a padded batch (beside a
text-only sequence of another length, so the bucket pads) against the model's own forward of
the image sequence alone (``reference_inputs``: its ``pixel_values`` as the processor batches
them, ``VisionModel.model_inputs``; Qwen's ``image_grid_thw``, LLaVA-NeXT's and Mistral-3's
``image_sizes``; ``mm_token_type_ids`` and positions by ``get_rope_index``; Gemma-3's
``token_type_ids``, as its processor makes them). A disagreement refuses to start: images are
never scored approximately. Runs on the executor's device and dtype (tolerance as the text
probe's)."""

from __future__ import annotations

import numpy as np
import torch

from worker.errors import ConfigError
from worker.executor.forward import BatchForward
from worker.executor.vision.arch import VisionModel
from worker.executor.vision.decode import Decoded
from worker.executor.vision.intake import (
    VisionIntake,
    check_sequence,
    rope_positions,
    vision_intake,
)
from worker.executor.vision.processor import ProcessedImage
from worker.scorer.inputs import PreparedSequence


def probe_image() -> Decoded:
    """A 84 x 56 RGB gradient (never read from a file)."""
    from PIL import Image

    y, x = np.mgrid[0:56, 0:84]
    pixels = np.stack([x * 3, y * 4, (x + y) * 2], axis=-1).astype("uint8")  # [56, 84, 3]
    return Decoded(image=Image.fromarray(pixels), digest="selfcheck-probe", format="PNG")


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
    runs = [[vlm.image_token] * n + [5] for n in processed.runs]  # a text token after each run
    ids = np.array([3, 4, *[t for run in runs for t in run], 6, 7, 8], dtype=np.int64)  # [L]
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


def checked_intake(forward: BatchForward, processor: object, config: object) -> VisionIntake | None:
    """``intake.vision_intake`` of the forward's reference model, its image path checked at
    load (``image_check``) unless ``config.self_check`` is off; ``None`` for a text-only model."""
    intake = vision_intake(forward.reference_model, processor, config)
    if intake is not None and getattr(config, "self_check", True):
        image_check(forward, intake)
    return intake
