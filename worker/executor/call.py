"""Planning a request, and one call of the plan as an object.

``plan_calls`` is where a request is planned, once, at intake (``StatelessExecutor.prepare``):
every sequence validated and normalised, and the calls it runs decided (one, or in ``both``
mode a ``reference`` call on the tokens and a ``reward`` call on what the reward model reads).
``merge_plans`` joins the plans of a batch's prepared requests into the calls the batch runs
(``StatelessExecutor.run``): the place where planning across requests of one batch belongs.

``ScoreCall`` is one such call at run time: its prepared inputs, batch plan, results and
tallies, and the metrics it reports. Everything a call accumulates lives in its ``ScoreCall``
(never on the executor), so calls do not share state and two threads may score at once.
``BatchResult`` is what one forward hands back to the call; ``concat_outputs`` joins the
outputs of calls over different sequences.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from worker.errors import BadRequest, TooLong, UnsupportedMode
from worker.executor.config import ExecutorConfig, Layout
from worker.executor.packing import plan_buckets, plan_packed_forwards, plan_padded
from worker.executor.rewards.surface import RewardSurface, untokenized
from worker.modes import LOGPROB_MODES, REWARD_MODES, Mode
from worker.request import DEFAULT_OPTIONS, ScoreOptions, ScoreRequest, SequenceInput
from worker.scorer.inputs import PreparedSequence, prepare_sequence
from worker.scorer.outputs import BatchMetrics, FallbackEvent, ScoreOutput, SequenceScore
from worker.scorer.plan import Prepared
from worker.scorer.teacher import check_call, gather_rows


def call_args(
    config: ExecutorConfig, served: Sequence[Mode], request: ScoreRequest
) -> tuple[Mode, float]:
    """The request's mode and temperature, ``None`` read as the configured ones (both checked
    where they were built); ``UnsupportedMode`` for a mode not served here."""
    mode = config.mode if request.mode is None else request.mode
    if mode not in served:
        raise UnsupportedMode(f"mode {mode!r} is not served here (serves {list(served)})")
    temp = config.temperature if request.temperature is None else request.temperature
    return mode, float(temp)


@dataclass(frozen=True)
class CallPlan:
    """One call of a plan: its mode and its sequences, checked and normalised."""

    mode: Mode
    seqs: tuple[PreparedSequence, ...]
    # images (vision.intake): files decoded and processor cache hits at intake
    images_decoded: int = 0
    cache_hits: int = 0


def plan_calls(
    surface: RewardSurface,
    seqs: Sequence[SequenceInput],
    mode: Mode,
    options: ScoreOptions,
    *,
    vocab: int,
    limit: int | None,
) -> tuple[CallPlan, ...]:
    """The calls one request runs, its sequences checked (``seqs`` as ``RewardSurface.prepare``
    returned them): one call; or, in ``both`` mode when the reward model reads other ids than
    the reference (``messages`` / ``text``, or another tokenizer), a ``reference`` call on the
    tokens and a ``reward`` call on the reward model's ids."""
    if mode not in REWARD_MODES:
        return (CallPlan(mode, tuple(check_sequences(seqs, vocab, limit, mode, options))),)
    if len(seqs) == 0:
        raise BadRequest("no sequences to score")
    if mode == "reward":
        check_call(options.outputs, mode, vocab)  # teacher outputs need log-probs
        return (CallPlan(mode, tuple(surface.reward_inputs(seqs, options))),)
    chat = any(isinstance(s, SequenceInput) and untokenized(s) for s in seqs)
    if not chat and surface.same_vocab is not False:  # one forward layout for both surfaces
        return (CallPlan(mode, tuple(check_sequences(seqs, vocab, limit, mode, options))),)
    return (
        CallPlan("reference", tuple(check_sequences(seqs, vocab, limit, "reference", options))),
        CallPlan("reward", tuple(surface.reward_inputs(seqs, options))),
    )


def merge_plans(batch: Sequence[Prepared]) -> list[tuple[list[int], tuple[CallPlan, ...]]]:
    """The calls a batch of prepared requests (one batch key) runs: requests whose plans have
    the same calls share them, each call holding their sequences in batch order. Each entry:
    the indices of its sequences in the batch (requests concatenated), and its calls."""
    shapes: dict[tuple[Mode, ...], tuple[list[int], list[list[PreparedSequence]]]] = {}
    decoded: dict[tuple[Mode, ...], list[int]] = {}
    offset = 0
    for prepared in batch:
        plan: tuple[CallPlan, ...] = prepared.plan
        shape = tuple(call.mode for call in plan)
        indices, parts = shapes.setdefault(shape, ([], [[] for _ in plan]))
        indices.extend(range(offset, offset + len(prepared)))
        for part, call in zip(parts, plan, strict=True):
            part.extend(call.seqs)
        counts = decoded.setdefault(shape, [0, 0])
        counts[0] += plan[0].images_decoded
        counts[1] += plan[0].cache_hits
        offset += len(prepared)
    return [
        (
            indices,
            tuple(
                CallPlan(m, tuple(p), *(decoded[shape] if k == 0 else (0, 0)))
                for k, (m, p) in enumerate(zip(shape, parts, strict=True))
            ),
        )
        for shape, (indices, parts) in shapes.items()
    ]


def check_sequences(
    seqs: Sequence[SequenceInput],
    vocab: int,
    limit: int | None,
    mode: Mode,
    options: ScoreOptions = DEFAULT_OPTIONS,
) -> list[PreparedSequence]:
    """Validate and normalise every sequence (and the teacher outputs ``options`` ask for, with
    each sequence's per-position gather ids); errors name the sequence's index."""
    if len(seqs) == 0:
        raise BadRequest("no sequences to score")
    needs_scored = mode in LOGPROB_MODES
    spec = options.outputs
    check_call(spec, mode, vocab)
    out = []
    for i, seq in enumerate(seqs):
        try:
            prepared = prepare_sequence(seq, vocab, limit, needs_scored)
            if getattr(seq, "aligned", None) is not None:  # a student sequence
                prepared = replace(prepared, aligned=seq.aligned)
            ids = getattr(seq, "gather_ids", None)
            if needs_scored and (ids is not None or spec.gather_width):
                n = len(prepared.scored) if prepared.scored is not None else 0
                prepared = replace(prepared, gather_ids=gather_rows(ids, n, spec, vocab))
            out.append(prepared)
        except (BadRequest, TooLong) as exc:
            raise type(exc)(f"sequence {i}: {exc.message}") from None
    return out


@dataclass(frozen=True)
class BatchResult:
    """What one forward produced (scores in its group's order) and what it cost."""

    scores: list[SequenceScore]
    backend: str
    packed: bool
    forward_s: float
    extra_tokens: int  # right padding (masked or unmasked bucket) or row fill (packed)
    kv_tensors: int = 0
    kv_bytes: int = 0
    forward_tokens: int = 0  # real tokens through the backbone (a shared prefix once)
    shared_tokens: int = 0  # tokens of the shared prefixes among them
    vision_images: int = 0  # images through the vision tower
    vision_s: float = 0.0


@dataclass
class ScoreCall:
    """The state of one ``score`` call: inputs, per-sequence results, tallies of its forwards."""

    mode: Mode
    temperature: float
    prepared: list[PreparedSequence]
    started: float = field(default_factory=time.perf_counter)
    options: ScoreOptions = DEFAULT_OPTIONS
    results: list[SequenceScore | None] = field(init=False)
    fallbacks: list[FallbackEvent] = field(default_factory=list)
    backends_used: list[str] = field(default_factory=list)
    kv_tensors: int = 0
    kv_bytes: int = 0
    oom_splits: int = 0
    forward_s: float = 0.0
    padded_tokens: int = 0
    fill_tokens: int = 0
    forwards: int = 0
    packed_any: bool = False
    forward_tokens: int = 0
    shared_tokens: int = 0
    images_decoded: int = 0
    cache_hits: int = 0
    vision_images: int = 0
    vision_s: float = 0.0
    # the vision tower's features by image (``vision.features.image_key``): an image shown in
    # several forwards of the call runs through the tower once
    features: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.results = [None] * len(self.prepared)

    @classmethod
    def of(
        cls, plan: CallPlan, temperature: float, options: ScoreOptions, started: float
    ) -> ScoreCall:
        """The call that runs ``plan`` (its intake's image counts carried over)."""
        return cls(
            plan.mode, temperature, list(plan.seqs), started, options=options,
            images_decoded=plan.images_decoded, cache_hits=plan.cache_hits,
        )  # fmt: skip

    @property
    def lengths(self) -> list[int]:
        """Token count of every sequence, input order."""
        return [len(p.ids) for p in self.prepared]

    def plan(
        self,
        config: ExecutorConfig,
        *,
        layout: Layout,
        backend: str,
        pad_fraction: float = 1.0,
        subset: Sequence[int] | None = None,
    ) -> list[list[int]]:
        """Indices of the sequences of each forward, under ``max_batch_tokens``: packed rows
        (several per forward, each capped by ``config.row_tokens(backend)``), unmasked buckets
        (padding within ``pad_fraction`` of their slots) or masked padded buckets; ``subset``:
        plan only those sequences (default: all)."""
        among = list(range(len(self.prepared))) if subset is None else list(subset)
        lengths = [len(self.prepared[i].ids) for i in among]
        if layout == "packed":
            forwards = plan_packed_forwards(
                lengths, config.max_batch_tokens, config.row_tokens(backend)
            )
            local = [[i for row in fwd for i in row] for fwd in forwards]
        elif layout == "unmasked":
            local = plan_buckets(lengths, config.max_batch_tokens, pad_fraction)
        else:
            local = plan_padded(lengths, config.max_batch_tokens)
        return [[among[i] for i in fwd] for fwd in local]

    def add(self, group: list[int], batch: BatchResult) -> None:
        """Record one forward of ``group`` (its scores and costs)."""
        for i, score in zip(group, batch.scores, strict=True):
            self.results[i] = score
        self.forward_s += batch.forward_s
        self.forwards += 1
        if batch.packed:
            self.fill_tokens += batch.extra_tokens
        else:
            self.padded_tokens += batch.extra_tokens
        self.backends_used.append(batch.backend)
        self.packed_any = self.packed_any or batch.packed
        self.kv_tensors += batch.kv_tensors
        self.kv_bytes += batch.kv_bytes
        self.forward_tokens += batch.forward_tokens
        self.shared_tokens += batch.shared_tokens
        self.vision_images += batch.vision_images
        self.vision_s += batch.vision_s

    def output(
        self,
        *,
        backend: str,
        requested_backend: str,
        peak: tuple[int, int],
        device_total: int | None,
    ) -> ScoreOutput:
        """Scores in input order and the call's metrics (``backend``: the one active between
        calls, reported when no forward ran)."""
        scored = sum(len(p.scored) for p in self.prepared if p.scored is not None)
        metrics = BatchMetrics(
            batch_size=len(self.prepared),
            real_tokens=sum(self.lengths),
            padded_tokens=self.padded_tokens,
            scored_tokens=scored if self.mode in LOGPROB_MODES else 0,
            elapsed_s=time.perf_counter() - self.started,
            forward_s=self.forward_s,
            backend=self.backends_used[-1] if self.backends_used else backend,
            requested_backend=requested_backend,
            fallbacks=self.fallbacks,
            kv_output_tensors=self.kv_tensors,
            kv_output_bytes=self.kv_bytes,
            kv_rejected=False,
            peak_allocated_bytes=peak[0],
            peak_reserved_bytes=peak[1],
            device_total_bytes=device_total,
            oom_splits=self.oom_splits,
            packed=self.packed_any,
            forwards=self.forwards,
            packed_fill_tokens=self.fill_tokens,
            forward_tokens=self.forward_tokens,
            shared_prefix_tokens=self.shared_tokens,
            images_decoded=self.images_decoded,
            processor_cache_hits=self.cache_hits,
            vision_images=self.vision_images,
            vision_s=self.vision_s,
            image_tokens=sum(
                sum(img.tokens for img in p.vision.images)
                for p in self.prepared
                if p.vision is not None
            ),
        )
        scores = [r if r is not None else SequenceScore() for r in self.results]
        return ScoreOutput(scores=scores, metrics=metrics)


def concat_outputs(parts: list[tuple[list[int], ScoreOutput]], total: int) -> ScoreOutput:
    """One output from the outputs of calls over different sequences of a batch (each with the
    indices of its sequences among ``total``): scores in batch order, costs summed (peaks: the
    largest)."""
    if len(parts) == 1:
        return parts[0][1]
    scores: list[SequenceScore | None] = [None] * total
    for indices, out in parts:
        for i, score in zip(indices, out.scores, strict=True):
            scores[i] = score
    ms = [out.metrics for _, out in parts]
    first = ms[0]
    metrics = replace(
        ms[-1],
        batch_size=sum(m.batch_size for m in ms),
        real_tokens=sum(m.real_tokens for m in ms),
        padded_tokens=sum(m.padded_tokens for m in ms),
        scored_tokens=sum(m.scored_tokens for m in ms),
        elapsed_s=max(m.elapsed_s for m in ms),
        forward_s=sum(m.forward_s for m in ms),
        fallbacks=[f for m in ms for f in m.fallbacks],
        kv_output_tensors=sum(m.kv_output_tensors for m in ms),
        kv_output_bytes=sum(m.kv_output_bytes for m in ms),
        peak_allocated_bytes=max(m.peak_allocated_bytes for m in ms),
        peak_reserved_bytes=max(m.peak_reserved_bytes for m in ms),
        device_total_bytes=first.device_total_bytes,
        oom_splits=sum(m.oom_splits for m in ms),
        packed=any(m.packed for m in ms),
        forwards=sum(m.forwards for m in ms),
        packed_fill_tokens=sum(m.packed_fill_tokens for m in ms),
        forward_tokens=sum(m.forward_tokens for m in ms),
        shared_prefix_tokens=sum(m.shared_prefix_tokens for m in ms),
        images_decoded=sum(m.images_decoded for m in ms),
        processor_cache_hits=sum(m.processor_cache_hits for m in ms),
        vision_images=sum(m.vision_images for m in ms),
        vision_s=sum(m.vision_s for m in ms),
        image_tokens=sum(m.image_tokens for m in ms),
    )
    return ScoreOutput(
        scores=[s if s is not None else SequenceScore() for s in scores], metrics=metrics
    )
