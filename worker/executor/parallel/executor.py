"""``ParallelExecutor``: the ``StatelessExecutor`` of one rank of a tensor-parallel group.

Every rank builds one, on its shards (``load``: each rank reads only its shard of every
weight, ``plan.tensor_parallel_plan``), and every rank runs the same ``run`` calls in the
same order (``group``). What it changes from one process:

* the forward is ``forward.ParallelForward`` (the vocabulary-parallel LM head, the votes);
* after each call every rank reports its peak memory (``Comm.gather_peaks``) and the call's
  metrics carry a ``GroupReport`` (size, devices, per-rank peaks, seconds in collectives);
* ``info`` names the group (``tensor_parallel``: its size, ``tensor_parallel_devices``) and
  the head (``lm_head``: ``vocab-parallel blocks``);
* refused: per-job adapters and versions (``weights``: never built here), and the
  ``processed_logps`` sampler (its support needs the whole distribution at once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from worker.errors import BadRequest, ConfigError
from worker.executor.config import ExecutorConfig
from worker.executor.core import StatelessExecutor
from worker.executor.forward import BatchForward
from worker.executor.parallel.collectives import Comm
from worker.executor.parallel.forward import ParallelForward
from worker.executor.parallel.plan import Plan
from worker.executor.rewards.pooling import RewardAdapter
from worker.executor.weights.loading import load_models, load_tokenizers, resolve_dtype
from worker.request import ScoreOptions, ScoreRequest
from worker.scorer.outputs import GroupReport, ScoreOutput
from worker.scorer.plan import Prepared

log = logging.getLogger(__name__)

__all__ = ["ParallelExecutor", "refuse_unsharded"]


def refuse_unsharded(options: ScoreOptions) -> None:
    """``BadRequest`` for what a group cannot serve yet: a sampler's ``processed_logps`` (its
    support needs the whole vocabulary on one rank), ``rank`` (it needs the label's logit on
    every shard first), a per-job adapter or version."""
    if options.outputs.sampling is not None:
        raise BadRequest(
            "processed_logps (a sampler's distribution) is not served under tensor "
            "parallelism yet: ask for logps, entropy, topk or gather"
        )
    if "rank" in options.outputs.outputs:
        raise BadRequest(
            "rank (each token's 1-based rank in its distribution) is not served under tensor "
            "parallelism yet: ask for logps, entropy, topk or gather"
        )
    if options.adapter is not None or options.version is not None:
        raise BadRequest("per-job adapters and versions are not served under tensor parallelism")


class ParallelExecutor(StatelessExecutor):
    """A ``StatelessExecutor`` on one rank of a group (module docstring); ``comm`` is the
    group's ``collectives.Comm``. The models must be sharded already (``load``)."""

    def __init__(
        self,
        config: ExecutorConfig,
        reference_model: nn.Module | None = None,
        reward_model: nn.Module | None = None,
        reward_adapter: RewardAdapter | None = None,
        model_name: str | None = None,
        *,
        comm: Comm,
        reward_model_name: str | None = None,
        tokenizers: tuple[Any, Any] | None = None,
    ) -> None:
        self.comm = comm  # before the base constructor: it builds the forward
        super().__init__(
            config,
            reference_model,
            reward_model,
            reward_adapter,
            model_name,
            reward_model_name=reward_model_name,
            tokenizers=tokenizers,
        )

    @property
    def forward_type(self) -> Callable[..., BatchForward]:  # type: ignore[override]
        """``ParallelForward`` on this executor's group."""
        return partial(ParallelForward, comm=self.comm)

    @classmethod
    def load(
        cls,
        config: ExecutorConfig,
        comm: Comm,
        plans: Sequence[Plan],
        reference_model: str | None = None,
        reward_model: str | None = None,
        *,
        trust_remote_code: bool = False,
        revision: str | None = None,
        reward_adapter: RewardAdapter | None = None,
        reward_head: str = "auto",
    ) -> ParallelExecutor:
        """Load each named model sharded over the group (every rank calls this at once, with
        the same arguments; ``plans`` are ``tensor_parallel_plan``'s for these checkpoints)."""
        if any(p.size != comm.size for p in plans) or not plans:
            raise ConfigError(f"plans for {[p.size for p in plans]} ranks, group of {comm.size}")
        device = comm.spec.device
        ref, rew = load_models(
            reference_model,
            reward_model,
            device=torch.device(device),
            dtype=resolve_dtype(config.dtype, torch.device(device)),
            trust_remote_code=trust_remote_code,
            revision=revision,
            reward_head=reward_head,
            distributed_config=plans[0].distributed_config(),
        )
        tokenizers = load_tokenizers(reference_model, reward_model)
        return cls(
            config,
            ref,
            rew,
            reward_adapter=reward_adapter,
            model_name=reference_model,
            comm=comm,
            reward_model_name=reward_model,
            tokenizers=tokenizers,
        )

    @property
    def info(self) -> dict[str, Any]:
        """``StatelessExecutor.info`` plus the group: its size and every rank's device."""
        info = super().info
        info["lm_head"] = "vocab-parallel blocks" if self.reference_model is not None else "none"
        info["tensor_parallel"] = self.comm.size
        info["tensor_parallel_devices"] = list(self.comm.spec.devices)
        return info

    def prepare(self, request: ScoreRequest) -> Prepared:
        """``StatelessExecutor.prepare``, refusing what a group cannot serve yet."""
        refuse_unsharded(request.options)
        return super().prepare(request)

    def run(self, batch: Sequence[Prepared]) -> ScoreOutput:
        """``StatelessExecutor.run`` on this rank (every rank of the group runs the same
        prepared batch, as the leader planned it), then every rank's peak memory into
        ``metrics.group``."""
        refuse_unsharded(batch[0].options)
        out = super().run(batch)
        peaks = self.comm.gather_peaks(out.metrics.peak_allocated_bytes)
        out.metrics.group = GroupReport(
            size=self.comm.size,
            devices=tuple(self.comm.spec.devices),
            rank_peak_bytes=peaks,
            collective_s=self.comm.take_seconds(),
        )
        return out
