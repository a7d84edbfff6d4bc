"""Process rewards, torch-free: the ``step`` job option and where a sequence's steps are.

A process reward model (PRM) scores every reasoning step, read at step positions: the positions
of a step-separator token (``tag_id``, e.g. Qwen2.5-Math-PRM's ``<extra_0>``, Math-Shepherd's
``ки``), or positions the producer gives per sequence (``step_positions``). ``StepOptions`` is the
job's ``step`` map (defined with the other request types in ``worker.request``);
``step_positions`` resolves one sequence's positions and checks them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from worker.errors import BadRequest
from worker.request import StepOptions
from worker.scorer.inputs import is_int

__all__ = ["StepOptions", "step_positions"]


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
