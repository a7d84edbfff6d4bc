"""Sequences on the wire: int32 token ids, completion masks and float32 score arrays.

Inputs are coerced from whatever the producer holds (lists, ``array``, bytes, numpy or torch,
duck-typed: neither is imported) and checked structurally by :func:`validate_seq`. Numeric arrays
travel as little-endian bin.
"""

from __future__ import annotations

import operator
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from worker.errors import ProtocolError
from worker.request import StudentView

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_LITTLE = sys.byteorder == "little"


@dataclass(frozen=True)
class SeqSpec:
    """One sequence of a job: int32 token ids and what to score.

    Exactly one of ``prompt_len`` (tokens from ``prompt_len`` on are scored) and ``mask``
    (one byte per token, 1 = scored, first byte 0) is set.
    """

    tokens: array  # typecode "i" (int32), native byte order
    prompt_len: int | None = None
    mask: bytes | None = None
    # teacher outputs: per-position gather ids, int32 row-major [num_scored, K] (flat)
    gather_ids: array | None = None
    # reward inputs (worker.protocol.rewards): a conversation rendered by the reward model's
    # chat template (tokens may then be empty in mode reward), process-reward step positions
    messages: tuple[dict[str, Any], ...] | None = None
    step_positions: array | None = None
    # text in: an already-templated string the worker tokenizes with its own tokenizer, as
    # given (add_special_tokens=False), scored instead of tokens like messages
    text: str | None = None
    # vision-language models: indices into the job's images (worker.protocol.images)
    images: tuple[int, ...] | None = None
    # a teacher with its own tokenizer: the student's view as text (worker.protocol.student)
    student: StudentView | None = None

    @property
    def num_scored(self) -> int:
        """How many tokens of this sequence are scored (a student sequence: at most its
        completion's UTF-8 bytes + 1, the most teacher tokens it can have)."""
        if self.student is not None:
            return len(self.student.completion.encode()) + 1
        if self.mask is not None:
            return sum(self.mask)
        if self.prompt_len is None:  # a messages- or text-only reward sequence
            return 0
        assert self.prompt_len is not None
        return len(self.tokens) - self.prompt_len


# ----------------------------------------------------------------------------- binary arrays


def le_bytes(arr: array) -> bytes:
    """Little-endian bytes of a numeric array."""
    if _LITTLE:
        return arr.tobytes()
    swapped = array(arr.typecode, arr)
    swapped.byteswap()
    return swapped.tobytes()


def from_le(typecode: str, data: bytes | memoryview) -> array:
    """An ``array`` of ``typecode`` from little-endian bytes."""
    out = array(typecode)
    out.frombytes(bytes(data))
    if not _LITTLE:
        out.byteswap()
    return out


def float_bin(values: Any) -> bytes:
    """Little-endian float32 bytes from an ``array('f')``, numpy array, or sequence of floats."""
    if isinstance(values, array) and values.typecode == "f":
        return le_bytes(values)
    if hasattr(values, "__array__") and hasattr(values, "astype"):
        return values.astype("<f4", copy=False).tobytes()
    return le_bytes(array("f", values))


# ----------------------------------------------------------------------------- coercion


def as_int32_array(tokens: Any) -> array:
    """Coerce token ids (list, tuple, ``array``, bytes of LE int32, numpy/torch) to ``array('i')``.

    A list or tuple may hold ints or integer scalars (numpy integers, 0-d integer numpy arrays or
    torch tensors, see ``token_id``). Raises ``ProtocolError`` for values outside int32 and for
    non-integer input (floats, booleans, strings...).
    """
    if isinstance(tokens, array):
        if tokens.typecode == "i":
            return tokens
        return as_int32_array(tokens.tolist())
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        data = bytes(tokens)
        if len(data) % 4:
            raise ProtocolError(f"tokens bin has {len(data)} bytes, not a multiple of 4 (int32)")
        return from_le("i", data)
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # a torch tensor, duck-typed
        tokens = tokens.detach().cpu().numpy()
    if hasattr(tokens, "__array__") and hasattr(tokens, "dtype"):  # numpy, duck-typed
        kind = getattr(tokens.dtype, "kind", "")
        if kind not in ("i", "u"):
            raise ProtocolError(f"tokens must be integers, got array of dtype {tokens.dtype}")
        if getattr(tokens, "ndim", 1) != 1:
            raise ProtocolError(f"tokens must be 1-D, got shape {tokens.shape}")
        if tokens.size and (int(tokens.min()) < _INT32_MIN or int(tokens.max()) > _INT32_MAX):
            raise ProtocolError("token id outside int32")
        return from_le("i", tokens.astype("<i4", copy=False).tobytes())
    if isinstance(tokens, (list, tuple)):
        values: Any = tokens
        for t in tokens:
            if not isinstance(t, int) or isinstance(t, bool):  # numpy/torch scalars, or bad
                values = [token_id(x, i) for i, x in enumerate(tokens)]
                break
        try:
            return array("i", values)
        except OverflowError as exc:
            raise ProtocolError("token id outside int32") from exc
    raise ProtocolError(f"tokens must be a list of ints or int32 bin, got {type(tokens).__name__}")


def is_bool_like(value: Any) -> bool:
    """A Python, numpy or torch boolean scalar (or 0-d boolean array/tensor)."""
    if isinstance(value, bool):
        return True
    dtype = getattr(value, "dtype", None)
    if dtype is None or getattr(value, "ndim", 0) != 0:
        return False
    return getattr(dtype, "kind", "") == "b" or str(dtype) == "torch.bool"


def token_id(value: Any, index: int = 0) -> int:
    """One token id as a Python int: an int or any integer scalar with ``__index__`` (numpy
    integer scalars, 0-d integer arrays and torch tensors). Booleans and floats are rejected."""
    what = type(value).__name__
    if is_bool_like(value):
        raise ProtocolError(f"token ids must be integers, got a boolean ({what}) at index {index}")
    if getattr(value, "ndim", 0) != 0:
        raise ProtocolError(f"token ids must be integer scalars, got a {what} at index {index}")
    try:
        return operator.index(value)
    except TypeError:
        dtype = getattr(value, "dtype", None)
        kind = f"{what} of dtype {dtype}" if dtype is not None and str(dtype) != what else what
        raise ProtocolError(f"token ids must be integers, got {kind} at index {index}") from None


def as_mask_bytes(mask: Any) -> bytes:
    """Coerce a completion mask (list of 0/1, bytes, numpy/torch bool/int) to bytes."""
    if isinstance(mask, (bytes, bytearray, memoryview)):
        return bytes(mask)
    if hasattr(mask, "detach") and hasattr(mask, "cpu"):
        mask = mask.detach().cpu().numpy()
    if hasattr(mask, "__array__") and hasattr(mask, "dtype"):
        return bytes(mask.astype("u1").tolist())
    if isinstance(mask, (list, tuple)):
        try:
            return bytes(int(m) for m in mask)
        except (TypeError, ValueError) as exc:
            raise ProtocolError("mask must hold 0/1 values") from exc
    raise ProtocolError(f"mask must be bin or an array of 0/1, got {type(mask).__name__}")


# ----------------------------------------------------------------------------- validation


def validate_seq(tokens: array, prompt_len: Any, mask: bytes | None, index: int) -> None:
    """Structural checks of one sequence (lengths, prompt_len range, mask values)."""
    n = len(tokens)
    where = f"seqs[{index}]"
    if n < 2:
        raise ProtocolError(
            f"{where}: needs at least 2 tokens (the first is never scored), got {n}"
        )
    if (prompt_len is None) == (mask is None):
        raise ProtocolError(f"{where}: give exactly one of prompt_len and mask")
    if prompt_len is not None:
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int):
            raise ProtocolError(f"{where}: prompt_len must be an int")
        if not 1 <= prompt_len < n:
            raise ProtocolError(f"{where}: prompt_len {prompt_len} outside [1, {n})")
    if mask is not None:
        if len(mask) != n:
            raise ProtocolError(f"{where}: mask has {len(mask)} entries for {n} tokens")
        if mask.strip(b"\x00\x01"):
            raise ProtocolError(f"{where}: mask values must be 0 or 1")
        if mask[0]:
            raise ProtocolError(f"{where}: mask[0] must be 0 (the first token has no context)")
        if 1 not in mask:
            raise ProtocolError(f"{where}: mask scores no token")


def seq_spec(seq: Mapping[str, Any], index: int = 0) -> SeqSpec:
    """A validated ``SeqSpec`` from a map with ``tokens`` and ``prompt_len`` or ``mask`` (and
    optional per-position ``gather_ids``, ``[n_scored, K]``)."""
    tokens = as_int32_array(seq["tokens"])
    mask = as_mask_bytes(seq["mask"]) if seq.get("mask") is not None else None
    prompt_len = seq.get("prompt_len")
    validate_seq(tokens, prompt_len, mask, index)
    spec = SeqSpec(tokens=tokens, prompt_len=prompt_len, mask=mask)
    if seq.get("gather_ids") is not None:
        spec = with_gather_ids(spec, seq["gather_ids"], index)
    refs = seq.get("images")  # indices into the job's images (worker.protocol.images)
    if refs is not None:
        if isinstance(refs, (str, bytes)) or not isinstance(refs, Sequence):
            raise ProtocolError(f"seqs[{index}].images must be a list of image indices")
        spec = replace(spec, images=tuple(refs))
    return spec


def with_gather_ids(spec: SeqSpec, ids: Any, index: int = 0) -> SeqSpec:
    """``spec`` carrying per-position gather ids (a ``[n_scored, K]`` array, nested lists, or
    int32 LE bin of ``n_scored * K`` ids); checks that the count is a multiple of n_scored."""
    if hasattr(ids, "detach") and hasattr(ids, "cpu"):  # torch, duck-typed
        ids = ids.detach().cpu().numpy()
    if hasattr(ids, "reshape") and hasattr(ids, "dtype"):  # numpy, flattened row-major
        ids = ids.reshape(-1)
    elif isinstance(ids, (list, tuple)) and ids and isinstance(ids[0], (list, tuple)):
        ids = [i for row in ids for i in row]
    try:
        flat = as_int32_array(ids)
    except ProtocolError as exc:
        raise ProtocolError(f"seqs[{index}].gather_ids: {exc.message}") from None
    n = spec.num_scored
    if not flat or len(flat) % n:
        raise ProtocolError(
            f"seqs[{index}].gather_ids has {len(flat)} ids for {n} scored tokens: "
            "expected n_scored x K"
        )
    return replace(spec, gather_ids=flat)


def seq_specs(seqs: Sequence[Mapping[str, Any]]) -> list[SeqSpec]:
    """Build validated ``SeqSpec`` objects from maps with ``tokens`` and ``prompt_len``/``mask``."""
    return [seq_spec(s, i) for i, s in enumerate(seqs)]
