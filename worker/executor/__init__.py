"""The stateless scoring executor (everything torch): ragged sequences in, log-probs and/or
rewards out. The contract is written down in ``docs/executor.md``.

Modules, by role:

* ``config``: ``ExecutorConfig`` and its validation.
* ``core``: ``StatelessExecutor``, the torch ``worker.scorer.Scorer`` (construction,
  ``prepare``, ``run``).
* ``call``: a request's plan (``plan_calls``, at ``prepare``; ``merge_plans``, at ``run``) and
  one call of it at run time (``ScoreCall``: inputs, batch plan, results, tallies, metrics).
* ``fallback``: running a planned batch: attention-backend fallback, OOM halving, KV guard.
* ``forward``: one batch's ``use_cache=False`` forward, log-probs and rewards.
* ``selfcheck``: the load-time probe (fast path vs the model's logits, packed vs one by one).
* ``kvcache``: KV-cache output detection and the per-forward ``KVGuard``.
* ``packing``, ``backends``, ``memory``: batch layouts, the backend chain, memory figures.

Sub-packages: ``head`` (the LM head: log-probs, vocabulary tiles, teacher outputs),
``weights`` (loading, per-job adapters and versions, residency), ``rewards`` (reward
adapters, process-reward heads, chat templates, the reward side of a call) and ``parallel``
(tensor parallelism: one model over the devices of a node).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from worker.modes import MODES, Mode
from worker.scorer.inputs import SequenceInput
from worker.scorer.outputs import BatchMetrics, FallbackEvent, ScoreOutput, SequenceScore

if TYPE_CHECKING:
    from worker.executor.config import ExecutorConfig
    from worker.executor.core import StatelessExecutor

# The torch-side names load on first use, so importing a torch-free module of this package
# (``worker.executor.weights.source``: a model path checked before anything loads) stays quick.
_LAZY = {"ExecutorConfig": "worker.executor.config", "StatelessExecutor": "worker.executor.core"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MODES",
    "BatchMetrics",
    "ExecutorConfig",
    "FallbackEvent",
    "Mode",
    "ScoreOutput",
    "SequenceInput",
    "SequenceScore",
    "StatelessExecutor",
]
