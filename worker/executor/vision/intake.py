"""A request's images at intake (``StatelessExecutor.prepare``): decode each file once, process
each distinct image once, check every sequence against the processor's counts, and compute
every sequence's positions by the model's own rule.

Checks, each a ``BadRequest`` naming the sequence (and the image): a video placeholder (video
inputs are not served); the number of runs of the image token against the runs of the images
the sequence names (each image owns an ordered list of runs, ``ProcessedImage.runs``: one for
most models, one per tile and the global image for a split SmolVLM / Idefics3 image, one per
row for Mistral-3); each run's length against the processor's token count for that run (the
model's rule, ``arch.VisionModel.count``: Qwen's ``t*h*w / merge**2``, LLaVA's patch grid,
Gemma-3's ``mm_tokens_per_image``, LLaVA-NeXT's size-dependent anyres count, ...). The model's
own check compares batch totals only, so a short run in one sequence and a long one in another
would pass it and misplace every feature after them.

Positions: for Qwen, ``get_rope_index`` of the model on the sequence alone (its
``mm_token_type_ids`` from the image-token runs), the 3-row mRoPE positions the model computes
for that sequence (``rope_deltas``, the model's cached state, is never read); for LLaVA and
Gemma-3 ``0 .. L-1``. The forward always passes them.

Each call of a plan is checked by the intake of the model that reads it (``plan_images``): the
reference model's for ``reference`` calls, the reward model's own for ``reward`` calls
(``RewardImages``: a ``Gemma3ForSequenceClassification`` or a VLM read through a hidden-state
adapter, with its own processor), the reference's for a ``both`` call of one model; a ``both``
call with images over two models is split into a ``reference`` and a ``reward`` call. A reward
model that takes no images (text-only, or read by an adapter that pools no hidden states) makes
a job with images in ``reward`` / ``both`` mode a ``BadRequest`` naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, wait
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from worker.errors import BadRequest, ConfigError
from worker.executor.call import CallPlan
from worker.executor.vision.arch import VisionModel, has_vision, vision_model
from worker.executor.vision.decode import decode_image
from worker.executor.vision.processor import ImageProcessing, ProcessedImage
from worker.request import Images, ScoreRequest
from worker.scorer.inputs import PreparedSequence


@dataclass(frozen=True)
class SequenceVision:
    """A sequence's images in order of appearance and its positions (``[3, L]`` mRoPE, or
    ``[L]``)."""

    images: tuple[ProcessedImage, ...]
    positions: np.ndarray  # [3, L] or [L] int64


@dataclass
class IntakeCounts:
    """What one request's intake did: files decoded, processor cache hits."""

    decoded: int = 0
    cache_hits: int = 0
    options: dict[str, int] = field(default_factory=dict)


def image_runs(ids: np.ndarray, token: int) -> list[tuple[int, int]]:
    """``(start, length)`` of every maximal run of ``token`` in ``ids``."""
    hit = np.concatenate([[False], ids == token, [False]])
    edges = np.flatnonzero(hit[1:] != hit[:-1])
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def process_images(
    images: Images, processing: ImageProcessing, *, max_pixels: int, max_images: int
) -> tuple[list[ProcessedImage], IntakeCounts]:
    """Every file of ``images`` decoded (once per distinct content) and processed; the distinct
    files at once on ``processing.pool`` (one at a time without one). A file that fails is
    the job's ``BadRequest`` as soon as it fails (the lowest index among those failed by then;
    files not started are dropped)."""
    if len(images.files) > max_images:
        raise BadRequest(
            f"the job has {len(images.files)} images, over the worker's limit of {max_images} "
            "(serve --max-images-per-job)"
        )
    processing.check(images.processor)
    counts = IntakeCounts(options=processing.describe(images.processor)["options"])
    firsts: dict[bytes, int] = {}  # each distinct file -> the index it first appears at
    for i, data in enumerate(images.files):
        firsts.setdefault(data, i)
    done = _process_distinct(firsts, processing, images.processor, max_pixels)
    for _, hit in done.values():
        counts.decoded += 1
        counts.cache_hits += int(hit)
    return [done[data][0] for data in images.files], counts


def _process_one(
    data: bytes, index: int, processing: ImageProcessing, options: Any, max_pixels: int
) -> tuple[ProcessedImage, bool]:
    """``data`` (``images[index]``) decoded and processed: (the output, a cache hit)."""
    return processing.process(decode_image(data, index, max_pixels=max_pixels), options)


def _process_distinct(
    firsts: dict[bytes, int], processing: ImageProcessing, options: Any, max_pixels: int
) -> dict[bytes, tuple[ProcessedImage, bool]]:
    """``_process_one`` of every distinct file (``firsts``: file -> its first index), on
    ``processing.pool`` when there is one and more than one file (``process_images``)."""
    pool = processing.pool
    if pool is None or len(firsts) < 2:
        return {d: _process_one(d, i, processing, options, max_pixels) for d, i in firsts.items()}
    futures = {
        pool.submit(_process_one, d, i, processing, options, max_pixels): (d, i)
        for d, i in firsts.items()
    }
    finished, pending = wait(futures, return_when=FIRST_EXCEPTION)
    failed = sorted(
        (futures[f][1], f) for f in finished if f.exception() is not None
    )  # by image index
    if failed:
        for f in pending:
            f.cancel()
        raise failed[0][1].exception()  # type: ignore[misc]
    return {futures[f][0]: f.result() for f in futures}


def check_sequence(
    seq: PreparedSequence, refs: Sequence[int], images: Sequence[ProcessedImage],
    model: VisionModel, index: int,
) -> PreparedSequence:  # fmt: skip
    """``seq`` with its ``SequenceVision`` and image-token positions taken out of its scored
    positions; ``BadRequest`` naming sequence ``index`` on a mismatch (module docstring)."""
    ids = seq.ids
    where = f"sequence {index}"
    if model.video_token is not None and bool(np.any(ids == model.video_token)):
        raise BadRequest(f"{where}: video inputs are not supported (video token found)")
    runs = image_runs(ids, model.image_token)
    shown = tuple(images[r] for r in refs)
    expected = sum(len(img.runs) for img in shown)
    if len(runs) != expected:
        made = "" if expected == len(refs) else f", which make {expected} runs"
        raise BadRequest(
            f"{where}: {len(runs)} runs of the image token but {len(refs)} images named{made}"
        )
    owners = [
        (ref, img, q) for ref, img in zip(refs, shown, strict=True) for q in range(len(img.runs))
    ]
    for k, ((_, n), (ref, img, q)) in enumerate(zip(runs, owners, strict=True)):
        want = img.runs[q]
        if n != want:
            which, of = (
                (f"images[{ref}]", "that image")
                if len(img.runs) == 1
                else (f"images[{ref}], its run {q + 1} of {len(img.runs)}", "that run")
            )
            raise BadRequest(
                f"{where}: image run {k} ({which}) has {n} image tokens but the processor "
                f"makes {want} for {of} ({model.describe(img.grid)})"
            )
    if not runs:
        return seq
    vision = SequenceVision(shown, rope_positions(model, ids, shown))
    scored = seq.scored
    if scored is not None:  # placeholder positions are never scored
        keep = ids[scored] != model.image_token
        if not keep.all():
            if not keep.any():
                raise BadRequest(f"{where}: every scored position is an image token")
            gather = seq.gather_ids[keep] if seq.gather_ids is not None else None
            return replace(seq, scored=scored[keep], gather_ids=gather, vision=vision)
    return replace(seq, vision=vision)


def rope_positions(
    model: VisionModel, ids: np.ndarray, images: Sequence[ProcessedImage]
) -> np.ndarray:
    """Positions of ``ids`` alone by the model's rule (``VisionModel.positions``)."""
    return model.positions(ids, [img.grid for img in images])


class VisionIntake:
    """A vision-language executor's intake of images (the module docstring), built once at load.

    ``model``: the served ``VisionModel``; ``processing``: its image processor with the cache;
    ``max_pixels`` / ``max_images``: the worker's limits per image and per job; ``sharing``:
    ``ExecutorConfig.image_sharing``."""

    def __init__(
        self,
        model: VisionModel,
        processing: ImageProcessing,
        *,
        max_pixels: int,
        max_images: int,
        sharing: str = "on",
    ) -> None:
        self.model = model
        self.processing = processing
        self.max_pixels = max_pixels
        self.max_images = max_images
        self.sharing = sharing

    @property
    def info(self) -> dict[str, Any]:
        """What results' ``info`` says of images: the processor, its backend and default
        options, and the positions (the layouts: ``layout.ImageLayouts.describe``)."""
        return {
            **self.processing.describe(),
            "model": self.model.name,
            "positions": "per-sequence mRoPE" if self.model.mrope else "per-sequence 0 .. L-1",
            **({"token_type_ids": "1 on image tokens"} if self.model.token_types else {}),
            "image_sharing": self.sharing,
        }

    def process(self, images: Images | None) -> tuple[list[ProcessedImage], IntakeCounts]:
        """A request's ``images`` through this model's processor (``process_images``)."""
        if images is None:
            return [], IntakeCounts()
        return process_images(
            images, self.processing, max_pixels=self.max_pixels, max_images=self.max_images
        )

    def check_call(
        self, call: CallPlan, request: ScoreRequest, shown: Sequence[ProcessedImage]
    ) -> CallPlan:
        """``call`` with every sequence checked against its images ``shown`` (processed by
        this model's processor; ``SequenceVision`` attached)."""
        seqs = tuple(
            check_sequence(seq, inp.images or (), shown, self.model, i)
            for i, (seq, inp) in enumerate(zip(call.seqs, request.seqs, strict=True))
        )
        return replace(call, seqs=seqs)


@dataclass(frozen=True)
class RewardImages:
    """How the reward model takes a job's images: ``intake``, its own (the reference model's
    when one model serves both surfaces: ``shared``), or ``None`` with ``why`` it takes none
    (the ``bad_request`` text of a reward call with images)."""

    intake: VisionIntake | None = None
    shared: bool = False
    why: str = "this worker serves no reward model"

    def info(self, layouts: Any) -> dict[str, Any]:
        """``reward_vision`` of results' ``info``: a separate image-text reward model's
        processor and its ``layouts`` (``ImageLayouts``); nothing when it takes no images or
        reads the reference model's hidden states."""
        if self.intake is None or self.shared or layouts is None:
            return {}
        return {"reward_vision": {**self.intake.info, **layouts.describe()}}


def has_images(request: ScoreRequest) -> bool:
    """Whether ``request`` carries or names images."""
    return request.images is not None or any(s.images for s in request.seqs)


def plan_images(
    vision: VisionIntake | None,
    request: ScoreRequest,
    plan: tuple[CallPlan, ...],
    reward: RewardImages = RewardImages(),
) -> tuple[CallPlan, ...]:
    """``plan`` with each call's sequences checked against their images by the intake of the
    model that reads them (``vision``: the reference model's, ``None`` for a text-only one;
    ``reward``: the reward model's), each model's processor run once per distinct image.

    A ``both`` call with images over two distinct models becomes a ``reference`` and a
    ``reward`` call (each model's own placeholders checked, positions and features); with one
    model (a hidden-state reward adapter on the VLM) it stays one call, one forward.
    ``BadRequest``: images for a text-only model, a reward model that takes none
    (``reward.why``), ``messages`` / ``text`` with images, step scores with images."""
    images = has_images(request)
    if not images and vision is None and reward.intake is None:
        return plan
    if images and request.options.step is not None:
        raise BadRequest("step scores are not served with images")
    done: dict[int, list[ProcessedImage]] = {}
    counts = IntakeCounts()

    def checked(intake: VisionIntake, call: CallPlan) -> CallPlan:
        if id(intake) not in done:
            done[id(intake)], got = intake.process(request.images)
            counts.decoded += got.decoded
            counts.cache_hits += got.cache_hits
        return intake.check_call(call, request, done[id(intake)])

    out: list[CallPlan] = []
    for call in plan:
        if call.mode == "reference" or (call.mode == "both" and (reward.shared or not images)):
            if vision is None:
                if images:
                    raise BadRequest(
                        "this worker serves a text-only model: a job with images is refused"
                    )
                out.append(call)
            else:
                out.append(checked(vision, call))
            continue
        if reward.intake is None:
            if images:
                raise BadRequest(reward.why)
            out.append(call)
            continue
        if images:
            for i, inp in enumerate(request.seqs):
                if inp.images and (inp.messages is not None or inp.text is not None):
                    raise BadRequest(
                        f"sequence {i}: images reach the reward model only with tokens "
                        "(placeholders expanded), not messages or text"
                    )
        if call.mode == "both":  # two models: each reads the images its own way
            if vision is None:
                raise BadRequest(
                    "this worker's reference model is text-only: a job with images is refused"
                )
            rewarded = tuple(replace(s, scored=None, gather_ids=None) for s in call.seqs)
            out.append(checked(vision, replace(call, mode="reference")))
            out.append(checked(reward.intake, CallPlan("reward", rewarded)))
            continue
        out.append(checked(reward.intake, call))
    out[0] = replace(out[0], images_decoded=counts.decoded, cache_hits=counts.cache_hits)
    return tuple(out)


def reward_images(model: Any, adapter: Any, processor: Any, config: Any) -> RewardImages:
    """How reward ``model`` read by ``adapter`` takes images (``RewardImages``): through its own
    intake (``vision_intake`` of ``model`` with its image ``processor``) when the model has a
    served vision tower and the adapter pools hidden states the worker computes
    (``HiddenStateRewardAdapter``: the image inputs reach the backbone); else none, and why."""
    from worker.executor.rewards.pooling import HiddenStateRewardAdapter

    if model is None:
        return RewardImages()
    name = type(model).__name__
    if not has_vision(getattr(model, "config", None)):
        return RewardImages(
            why=f"the reward model {name} is text-only: it cannot read this job's images "
            "(score them in mode 'reference', or serve an image-text reward model)"
        )
    if not isinstance(adapter, HiddenStateRewardAdapter):
        return RewardImages(
            why=f"images are not served for the image-text reward model {name} read through "
            f"{type(adapter).__name__}: images reach a reward head only through a hidden-state "
            "adapter (the model's own head, a value head)"
        )
    try:
        return RewardImages(vision_intake(model, processor, config))
    except ConfigError as exc:
        return RewardImages(
            why=f"images are not served for the image-text reward model {name}: {exc}"
        )


def vision_intake(model: Any, processor: Any, config: Any) -> VisionIntake | None:
    """The intake of a served vision-language ``model`` with its image ``processor`` (``None``
    for a text-only model); ``ConfigError`` for an image-text model not served, or one without
    its processor. ``config``: the ``ExecutorConfig`` (the image limits)."""
    vlm = vision_model(model) if model is not None else None
    if vlm is None:
        return None
    if processor is None:
        raise ConfigError(f"{vlm.name} needs its image processor (preprocessor_config.json)")
    return VisionIntake(
        vlm,
        ImageProcessing(processor, vlm, threads=getattr(config, "image_threads", 1)),
        max_pixels=config.max_image_pixels,
        max_images=config.max_images_per_job,
        sharing=getattr(config, "image_sharing", "on"),
    )
