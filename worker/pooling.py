"""Documented import path of the reward-adapter API (``worker.pooling.RewardAdapter``) that
``--reward-adapter`` factories are written against.

The implementation lives in ``worker.executor.rewards.pooling``; this module only re-exports it.
"""

from worker.executor.rewards.pooling import (
    HiddenStateRewardAdapter,
    RewardAdapter,
    RewardOutput,
    SequenceClassificationAdapter,
    ValueHeadAdapter,
)

__all__ = [
    "HiddenStateRewardAdapter",
    "RewardAdapter",
    "RewardOutput",
    "SequenceClassificationAdapter",
    "ValueHeadAdapter",
]
