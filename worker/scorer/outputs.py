"""What a scorer returns: per-sequence scores and the batch's metrics.

Plain dataclasses with no torch import, shared by the executor and the no-op scorer (so a
``--scorer noop`` worker, or a producer that only decodes, never loads torch).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from worker.errors import ScoringError
    from worker.scorer.weights import WeightsReport


@dataclass
class FallbackEvent:
    """One attention-backend fallback: what was asked, what ran, and why."""

    requested: str
    used: str
    reason: str  # not_installed | unsupported_dtype | unsupported_device | kernel_error | ...
    message: str
    at: Literal["load", "run"]

    def as_dict(self) -> dict[str, str]:
        """Plain dict (for ``info`` and result metadata)."""
        return asdict(self)


@dataclass
class SequenceScore:
    """Result for one sequence; on a per-sequence failure only ``error`` is set."""

    logps: np.ndarray | None = None  # [n_scored] output_dtype
    reward: float | None = None
    token_scores: np.ndarray | None = None  # [len] when the adapter is token-level
    error: ScoringError | None = None
    # reward inputs and heads: the reward model's token count (messages), every objective of a
    # multi-objective head, process-reward step positions and scores
    rm_tokens: int | None = None
    rewards: np.ndarray | None = None  # [K] float32 when the head has K > 1 outputs
    step_positions: np.ndarray | None = None  # [k] int32
    step_scores: np.ndarray | None = None  # [k] float32
    # teacher outputs: entropy, topk_ids, topk_logps, ... float32/int32 [n_scored(, width)]
    arrays: dict[str, np.ndarray] | None = None
    # tokens of this sequence computed once for several (the shared prefix of its tree row; 0
    # when it ran alone)
    shared_tokens: int = 0


@dataclass(frozen=True)
class GroupReport:
    """A tensor-parallel group's side of one call: its ``size``, each rank's device and peak
    memory during the call (rank order; CUDA peak allocated, or the process's peak RSS on CPU),
    and the seconds the leader spent in the group's collectives, by kind (``broadcast``,
    ``vote``, ``head``, ``peaks``; ``worker.executor.parallel.collectives``)."""

    size: int
    devices: tuple[str, ...]
    rank_peak_bytes: tuple[int, ...]
    collective_s: dict[str, float]


@dataclass
class BatchMetrics:
    """What one ``score`` call cost and how it ran."""

    batch_size: int
    real_tokens: int
    padded_tokens: int
    scored_tokens: int
    elapsed_s: float
    forward_s: float
    backend: str
    requested_backend: str
    fallbacks: list[FallbackEvent]
    kv_output_tensors: int
    kv_output_bytes: int
    kv_rejected: bool
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int | None
    oom_splits: int
    packed: bool
    forwards: int = 0
    packed_fill_tokens: int = 0
    # tokens through the backbone (each shared prefix once), and the shared prefixes' tokens
    forward_tokens: int = 0
    shared_prefix_tokens: int = 0
    # images (vision-language models): files decoded and processor cache hits at the intake of
    # the batch's requests; images through the vision tower, its seconds; image tokens forwarded
    images_decoded: int = 0
    processor_cache_hits: int = 0
    vision_images: int = 0
    vision_s: float = 0.0
    image_tokens: int = 0
    # Per-job weights: which adapter/version ran, loads and residency (None: base only).
    weights: WeightsReport | None = None
    # Tensor parallelism: the group's ranks and collectives (None: one process).
    group: GroupReport | None = None


@dataclass
class ScoreOutput:
    """Scores in input order plus the call's metrics."""

    scores: list[SequenceScore]
    metrics: BatchMetrics
