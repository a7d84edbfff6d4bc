"""One batch's forward on every rank of a tensor-parallel group: the single-device
``BatchForward`` with the vocabulary-parallel LM head and a vote that keeps the ranks in step.

``ParallelForward.compute`` (and ``compute_tree``, tree rows) runs the inherited forward
(layouts, backbones, rewards, teacher outputs) on this rank's shards. Its LM head
(``head_outputs``) folds this rank's vocabulary shard (``head.fold_shard``), votes, then
all-gathers the per-row statistics and finishes them (``head.combine``); every forward ends
with a second vote. The votes
(``collectives.Comm.agree``) make a failure on any rank a failure on all, of the same kind, so
``fallback.BatchRunner`` above takes the same branch on every rank:

==================  =============================  ==========================================
worst failure       every rank raises              so ``BatchRunner`` on every rank
==================  =============================  ==========================================
other error         its own, or ``RuntimeError``   ends the batch (``InternalError``)
``ScoringError``    its own, or one with the code  passes it up (e.g. ``bad_request``)
device OOM          its own, or an OOM stand-in    halves the batch (an OOM on any rank
                                                   halves it on all)
attention kernel    its own, or a stand-in marked  retries on the next backend
                    ``attention_kernel_error``
==================  =============================  ==========================================

A rank that failed raises its own exception when it is of the chosen kind (its traceback
intact), a stand-in naming the first rank that failed otherwise. A failure inside a collective
(a peer gone) never votes: it takes the process down (``Comm.fatal``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from worker.errors import BadRequest, ScoringError
from worker.executor import backends
from worker.executor.config import ExecutorConfig
from worker.executor.forward import BatchForward, Computed
from worker.executor.parallel.collectives import Comm, is_collective_failure
from worker.executor.parallel.head import Columns, combine, fold_shard, vocab_shard
from worker.executor.rewards.pooling import RewardAdapter
from worker.scorer.inputs import PreparedSequence
from worker.scorer.teacher import TokenOutputs

__all__ = ["KINDS", "ParallelForward", "describe", "mirror"]

KINDS = ("kernel", "oom", "scoring", "error")
"""Failure kinds, the one every rank raises last (``mirror`` picks the worst)."""


def describe(exc: BaseException, rank: int) -> tuple[str, int, str, str]:
    """``(kind, rank, error code, message)``: what this rank tells the others in a vote."""
    code = exc.code if isinstance(exc, ScoringError) else ""
    return _kind(exc), rank, code, f"{type(exc).__name__}: {exc}"[:400]


def _kind(exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError):
        return "oom"
    if isinstance(exc, ScoringError):
        return "scoring"
    if isinstance(exc, Exception) and backends.is_attention_kernel_error(exc):
        return "kernel"
    return "error"


def mirror(failures: list[Any], own: BaseException | None) -> BaseException:
    """What this rank raises after a vote where some ranks failed (``failures``: each rank's
    ``describe`` or ``None``): ``own`` when it is of the worst kind, else a stand-in of that
    kind naming the first rank that had it (module table)."""
    found = [f for f in failures if f is not None]
    worst = max(KINDS.index(f[0]) for f in found)
    kind, rank, code, message = next(f for f in found if KINDS.index(f[0]) == worst)
    if own is not None and _kind(own) == kind:
        return own
    text = f"on rank {rank} of the tensor-parallel group: {message}"
    if kind == "oom":
        return torch.OutOfMemoryError(text)
    if kind == "scoring":
        return ScoringError(text, code=code or None)
    stand_in = RuntimeError(text)
    if kind == "kernel":
        stand_in.attention_kernel_error = True  # type: ignore[attr-defined]
    return stand_in


class ParallelForward(BatchForward):
    """``BatchForward`` on one rank of a group (module docstring); ``comm`` holds the group's
    collectives. The reference model's LM head must be split on the vocabulary."""

    def __init__(
        self,
        config: ExecutorConfig,
        device: torch.device,
        reference_model: Any,
        reward_model: Any,
        reward_adapter: RewardAdapter | None,
        comm: Comm,
    ) -> None:
        super().__init__(config, device, reference_model, reward_model, reward_adapter)
        self.comm = comm
        self.shard = (
            vocab_shard(reference_model.get_output_embeddings(), comm.rank, comm.size)
            if reference_model is not None
            else None
        )
        self._failed = False  # this forward's vote said a rank failed (everyone raised)
        # the rows after the final norm are the same on every rank: the leader's go into the
        # result, a follower (whose result is dropped) never casts nor copies its own
        self.keeps_hidden = comm.rank == 0

    def compute(self, *args: Any, **kwargs: Any) -> Computed:
        """``BatchForward.compute``, then a vote: the same outcome on every rank."""
        return self._voted(super().compute, *args, **kwargs)

    def compute_tree(self, *args: Any, **kwargs: Any) -> Computed:
        """``BatchForward.compute_tree`` (tree rows: every rank plans the same trees from the
        broadcast call), then a vote: the same outcome on every rank."""
        return self._voted(super().compute_tree, *args, **kwargs)

    def _voted(self, run: Callable[..., Computed], *args: Any, **kwargs: Any) -> Computed:
        """``run(*args, **kwargs)`` on this rank, then the vote (module docstring)."""
        self._failed = False
        try:
            computed = run(*args, **kwargs)
        except Exception as exc:
            if self._failed:  # raised by a vote: every rank raises alike already
                raise
            if is_collective_failure(exc):
                self.comm.fatal(
                    f"rank {self.comm.rank}: a collective of the forward failed: "
                    f"{type(exc).__name__}: {exc}"[:500]
                )
            self._agree(exc)
            raise
        self._agree(None)
        return computed

    def _agree(self, exc: BaseException | None) -> None:
        """Vote (``Comm.agree``); raise what ``mirror`` says when any rank failed."""
        if self.device.type == "cuda":  # a collective queued on the stream must finish first
            torch.cuda.synchronize(self.device)
        failures = self.comm.agree(None if exc is None else describe(exc, self.comm.rank))
        if failures:
            self._failed = True
            raised = mirror(failures, exc)
            if raised is exc:
                raise raised
            raise raised from exc

    def head_outputs(
        self,
        picked: torch.Tensor,
        labels: torch.Tensor,
        ordered: list[PreparedSequence],
        spec: TokenOutputs,
    ) -> dict[str, torch.Tensor]:
        """The vocabulary-parallel head: fold this rank's shard, vote, all-gather the per-row
        statistics, combine (``head``); the same arrays as ``BatchForward.head_outputs``."""
        shard = self.shard
        assert shard is not None and self.transform is not None
        if spec.sampling is not None or "rank" in spec.outputs:
            raise BadRequest("processed_logps and rank are not served under tensor parallelism yet")
        spec.check_vocab(shard.vocab)
        gather = None
        if spec.gather_width:
            rows = [s.gather_ids for s in ordered]
            assert all(r is not None for r in rows)
            gather = torch.from_numpy(np.concatenate(rows)).to(self.device)  # type: ignore[arg-type]
        elif spec.gather_ids:
            gather = torch.tensor(spec.gather_ids, dtype=torch.long, device=self.device)  # [K]
        cols = Columns.of(spec)
        half = shard.weight.dtype != torch.float32
        stats = fold_shard(
            picked,
            shard,
            labels,
            cols,
            temperature=spec.temperature,
            transform=self.transform,
            gather_ids=gather,
            chunk_rows=self._chunk_rows(None, 1.5 if half else 1.0, shard.width),
        )  # [N, C]
        self._agree(None)  # nothing is combined before every rank folded its shard
        return combine(self.comm.combine_rows(stats), cols, spec)
