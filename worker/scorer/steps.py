"""Process rewards, torch-free: the ``step`` job option and where a sequence's steps are.

A process reward model (PRM) scores every reasoning step, read at step positions: the positions
of a step-separator token (``tag_id``, e.g. Qwen2.5-Math-PRM's ``<extra_0>``, Math-Shepherd's
``ки``), or positions the producer gives per sequence (``step_positions``). ``StepOptions`` is the
job's ``step`` map; ``step_positions`` resolves one sequence's positions and checks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from worker.errors import BadRequest
from worker.scorer.inputs import is_int

__all__ = ["StepOptions", "step_positions"]


@dataclass(frozen=True)
class StepOptions:
    """The ``step`` map of a process-reward job.

    ``tag_id``: the step-separator token id (every position holding it is a step), or ``None``
    when each sequence gives its ``step_positions``. ``label_token_ids``: ``(good, bad)`` token
    ids for an LM-label head (a ``*ForCausalLM`` PRM: the step score is ``softmax([logit_good,
    logit_bad])[0]``). ``positive_index``: the class of a 2-label token-classification head whose
    probability is the step score (default 1).
    """

    tag_id: int | None = None
    label_token_ids: tuple[int, int] | None = None
    positive_index: int = 1

    def check(self, vocab: int) -> None:
        """``BadRequest`` when a token id is outside ``[0, vocab)`` or the index is not 0/1."""
        if self.tag_id is not None and not 0 <= self.tag_id < vocab:
            raise BadRequest(
                f"step tag_id {self.tag_id} is outside the reward model's vocabulary [0, {vocab})"
            )
        for t in self.label_token_ids or ():
            if not 0 <= t < vocab:
                raise BadRequest(
                    f"step label token id {t} is outside the reward model's vocabulary [0, {vocab})"
                )
        if self.positive_index not in (0, 1):
            raise BadRequest(f"step positive_index must be 0 or 1, got {self.positive_index}")


def step_positions(ids: np.ndarray, given: Any, step: StepOptions) -> np.ndarray:
    """One sequence's step positions (int64, increasing) in its ids ``[L]``: ``given`` (the
    sequence's ``step_positions``: each in ``[0, L)``, strictly increasing) when set, else every
    position whose id is ``step.tag_id``. May be empty; ``BadRequest`` when neither is given."""
    n = int(ids.size)
    if given is not None:
        raw = np.frombuffer(bytes(given), "<i4") if isinstance(given, (bytes, bytearray)) else None
        try:
            arr = raw if raw is not None else np.asarray(given)
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"step_positions are not an integer array: {exc}") from None
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise BadRequest("step_positions must be a 1-D array of ints")
        pos = arr.astype(np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= n):
            raise BadRequest(f"step_positions must lie in [0, {n}) (the reward model's tokens)")
        if pos.size > 1 and not (np.diff(pos) > 0).all():
            raise BadRequest("step_positions must be strictly increasing")
        return pos
    if step.tag_id is None or not is_int(step.tag_id):
        raise BadRequest("a step job needs step.tag_id or step_positions on every sequence")
    return np.flatnonzero(ids == step.tag_id).astype(np.int64)
