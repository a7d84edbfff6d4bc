"""Input validation and preparation for the executor: ragged token sequences to int64 arrays and
the positions whose token is scored. Pure numpy (torch tensors are accepted and moved to CPU)."""

from __future__ import annotations

import array
import numbers
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from worker.errors import BadRequest, TooLong
from worker.request import SequenceInput

__all__ = [
    "PreparedSequence",
    "SequenceInput",
    "as_ids",
    "is_int",
    "mask_positions",
    "prepare_sequence",
]


@dataclass(frozen=True)
class PreparedSequence:
    """A validated sequence: int64 ids and the positions whose token is scored (or None)."""

    ids: np.ndarray  # [L] int64
    scored: np.ndarray | None  # [n] int64 positions t >= 1
    # reward inputs: step positions read by a process-reward head; the reward model's token
    # count when ``ids`` were rendered from messages or tokenized from text
    steps: np.ndarray | None = None  # [k] int64 positions in [0, L)
    rm_tokens: int | None = None
    gather_ids: np.ndarray | None = None  # [n, K] int64 (teacher outputs), checked
    # vision-language models: the images this sequence shows and its positions, numpy only
    # (worker.executor.vision.intake.SequenceVision); None: text only
    vision: Any = None
    # a student sequence: where its student and teacher tokens cut the completion alike
    aligned: Any = None  # worker.scorer.align.Alignment


def _is_tensor(value: Any) -> bool:
    """True for a torch tensor, without importing torch (none exists unless torch is loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_int(value: Any) -> bool:
    """True for an integer that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_ids(tokens: Any) -> np.ndarray:
    """``tokens`` as a 1-D integer array (not yet range-checked)."""
    if _is_tensor(tokens):
        arr = tokens.detach().cpu().numpy()
    elif isinstance(tokens, (str, bytes, bytearray)) or tokens is None:
        raise BadRequest(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
    elif isinstance(tokens, array.array):
        arr = (
            np.frombuffer(tokens, dtype=tokens.typecode)
            if tokens.typecode in "bBhHiIlLqQ"
            else np.asarray(tokens)
        )
    else:
        try:
            arr = np.asarray(tokens)
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"tokens are not an integer array: {exc}") from None
    if arr.ndim != 1:
        raise BadRequest(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise BadRequest(f"tokens must be integers, got dtype {arr.dtype}")
    return arr


def prepare_sequence(
    seq: Any, vocab: int, limit: int | None, needs_scored: bool
) -> PreparedSequence:
    """Validate one ``SequenceInput`` (ids in ``[0, vocab)``, length within ``limit``, prompt_len
    or mask) and return its int64 ids and scored positions; raises ``BadRequest``/``TooLong``."""
    if not isinstance(seq, SequenceInput):
        raise BadRequest(f"expected SequenceInput, got {type(seq).__name__}")
    arr = as_ids(seq.tokens)
    n = int(arr.size)
    minimum = 2 if needs_scored else 1
    if n < minimum:
        raise BadRequest(f"needs at least {minimum} tokens, got {n}")
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise BadRequest(f"token id {bad} outside [0, {vocab})")
    if limit is not None and n > limit:
        raise TooLong(f"{n} tokens exceed the model's {limit} positions")
    ids = arr.astype(np.int64)
    if seq.prompt_len is not None and seq.mask is not None:
        raise BadRequest("give prompt_len or mask, not both")
    if seq.prompt_len is not None:
        p = seq.prompt_len
        if not is_int(p):
            raise BadRequest(f"prompt_len must be an int, got {type(p).__name__}")
        if not 1 <= int(p) < n:
            raise BadRequest(f"prompt_len {p} outside [1, {n})")
        return PreparedSequence(ids=ids, scored=np.arange(int(p), n, dtype=np.int64))
    if seq.mask is not None:
        return PreparedSequence(ids=ids, scored=mask_positions(seq.mask, n))
    if needs_scored:
        raise BadRequest("log-probs need prompt_len or mask")
    return PreparedSequence(ids=ids, scored=None)


def mask_positions(mask: Any, n: int) -> np.ndarray:
    """Positions whose mask entry is 1; checks length, 0/1 values, ``mask[0] == 0``, one scored."""
    if isinstance(mask, (bytes, bytearray, memoryview)):
        m = np.frombuffer(bytes(mask), dtype=np.uint8)
    elif _is_tensor(mask):
        m = mask.detach().cpu().numpy()
    else:
        try:
            m = np.asarray(mask)
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"mask is not an array of 0/1: {exc}") from None
    if m.ndim != 1 or m.size != n:
        raise BadRequest(f"mask has {m.size} entries for {n} tokens")
    if m.dtype.kind not in "iub" or not np.isin(m, (0, 1)).all():
        raise BadRequest("mask values must be 0 or 1")
    if m[0]:
        raise BadRequest("mask[0] must be 0: the first token has no context to be scored from")
    scored = np.flatnonzero(m).astype(np.int64)
    if scored.size == 0:
        raise BadRequest("mask scores no token")
    return scored
