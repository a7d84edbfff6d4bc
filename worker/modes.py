"""The scoring modes: the one place that names them (protocol, client, scorers and CLI import it).

``reference``: log-probs of the scored tokens under the reference model; ``reward``: one reward per
sequence; ``both``: the two in one job.
"""

from __future__ import annotations

from typing import Literal, get_args

Mode = Literal["reference", "reward", "both"]
MODES: tuple[Mode, ...] = get_args(Mode)
#: Modes that produce per-token log-probs (and so need scored positions).
LOGPROB_MODES: tuple[Mode, ...] = ("reference", "both")
#: Modes that produce a reward.
REWARD_MODES: tuple[Mode, ...] = ("reward", "both")

__all__ = ["LOGPROB_MODES", "MODES", "REWARD_MODES", "Mode"]
