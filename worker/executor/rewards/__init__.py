"""The reward surfaces: how a reward model is read.

* ``pooling``: reward adapters (``RewardAdapter``, ``SequenceClassificationAdapter``,
  ``ValueHeadAdapter``), pooled at each sequence's true last token.
* ``steps``: process-reward heads (token classification, an LM label) scored at step positions.
* ``chat``: the reward model's own chat template over ``messages``.
* ``surface``: ``RewardSurface``, what reward calls need beside the forward, and the calls a
  ``score`` runs.
"""

from __future__ import annotations

from worker.executor.rewards.pooling import (
    RewardAdapter,
    RewardOutput,
    SequenceClassificationAdapter,
    ValueHeadAdapter,
)

__all__ = ["RewardAdapter", "RewardOutput", "SequenceClassificationAdapter", "ValueHeadAdapter"]
