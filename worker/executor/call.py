"""One ``score`` call as an object: its checked arguments, prepared inputs, batch plan, results
and tallies, and the metrics it reports.

Everything a call accumulates lives in its ``ScoreCall`` (never on the executor), so calls do
not share state and two threads may score at once. ``BatchResult`` is what one forward hands
back to the call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from worker.errors import BadRequest, TooLong, UnsupportedMode
from worker.executor.config import ExecutorConfig, Layout, positive_float
from worker.executor.packing import plan_buckets, plan_packed_forwards, plan_padded
from worker.modes import LOGPROB_MODES, MODES, Mode
from worker.scorer.inputs import PreparedSequence, SequenceInput, prepare_sequence
from worker.scorer.options import DEFAULT_OPTIONS, ScoreOptions
from worker.scorer.outputs import BatchMetrics, FallbackEvent, ScoreOutput, SequenceScore
from worker.scorer.teacher import check_call, gather_rows


def call_args(
    config: ExecutorConfig, served: Sequence[Mode], mode: str | None, temperature: float | None
) -> tuple[Mode, float]:
    """The call's mode and temperature (``None``: the configured ones), checked."""
    mode = config.mode if mode is None else mode
    if mode not in MODES:
        raise BadRequest(f"unknown mode {mode!r}; expected one of {MODES}")
    if mode not in served:
        raise UnsupportedMode(f"mode {mode!r} is not served here (serves {list(served)})")
    temp = config.temperature if temperature is None else temperature
    if not positive_float(temp):
        raise BadRequest(f"temperature must be a finite number > 0, got {temp!r}")
    return mode, float(temp)


def prepare(
    seqs: Sequence[SequenceInput],
    vocab: int,
    limit: int | None,
    mode: Mode,
    options: ScoreOptions = DEFAULT_OPTIONS,
) -> list[PreparedSequence]:
    """Validate and normalise every sequence (and the teacher outputs ``options`` ask for, with
    each sequence's per-position gather ids); errors name the sequence's index."""
    if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Sequence):
        raise BadRequest(f"expected a list of SequenceInput, got {type(seqs).__name__}")
    if len(seqs) == 0:
        raise BadRequest("no sequences to score")
    needs_scored = mode in LOGPROB_MODES
    spec = options.outputs
    check_call(spec, mode, vocab)
    out = []
    for i, seq in enumerate(seqs):
        try:
            prepared = prepare_sequence(seq, vocab, limit, needs_scored)
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

    def __post_init__(self) -> None:
        self.results = [None] * len(self.prepared)

    @property
    def lengths(self) -> list[int]:
        """Token count of every sequence, input order."""
        return [len(p.ids) for p in self.prepared]

    def plan(
        self, config: ExecutorConfig, *, layout: Layout, backend: str, pad_fraction: float = 1.0
    ) -> list[list[int]]:
        """Indices of the sequences of each forward, under ``max_batch_tokens``: packed rows
        (several per forward, each capped by ``config.row_tokens(backend)``), unmasked buckets
        (padding within ``pad_fraction`` of their slots) or masked padded buckets."""
        if layout == "packed":
            forwards = plan_packed_forwards(
                self.lengths, config.max_batch_tokens, config.row_tokens(backend)
            )
            return [[i for row in fwd for i in row] for fwd in forwards]
        if layout == "unmasked":
            return plan_buckets(self.lengths, config.max_batch_tokens, pad_fraction)
        return plan_padded(self.lengths, config.max_batch_tokens)

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
        )
        scores = [r if r is not None else SequenceScore() for r in self.results]
        return ScoreOutput(scores=scores, metrics=metrics)
