"""The job's ``prefix`` (protocol v1, additive): token ids every sequence of the job starts with,
sent once.

A GRPO group scores G completions of one prompt; an agent's rollouts share their earlier turns.
With ``prefix`` (int32 LE bin or an array of ints, like ``tokens``) each sequence of the job is
``prefix + tokens``: its ``tokens`` on the wire are what follows the prefix, its
``prompt_len`` defaults to ``len(prefix)``, and ``prompt_len``, ``mask`` and per-position
``gather_ids`` count over the whole sequence. Decoding expands the prefix, so everything after
the wire sees whole sequences (and the worker's own prefix detection shares it).
"""

from __future__ import annotations

from array import array
from typing import Any

from worker.errors import ProtocolError
from worker.protocol.seqs import SeqSpec, as_int32_array

__all__ = ["after_prefix", "check_prefix", "decode_prefix"]


def check_prefix(head: array) -> array:
    """``head`` when it holds at least one token id (>= 0)."""
    if len(head) == 0:
        raise ProtocolError("prefix must hold at least one token id")
    if min(head) < 0:
        raise ProtocolError("prefix token ids must be >= 0")
    return head


def decode_prefix(raw: Any) -> array | None:
    """The job's ``prefix`` as ``array('i')`` (``None`` when absent)."""
    if raw is None:
        return None
    try:
        return check_prefix(as_int32_array(raw))
    except ProtocolError as exc:
        raise ProtocolError(f"prefix: {exc.message}") from None


def after_prefix(spec: SeqSpec, head: array, index: int) -> array:
    """The tokens of ``spec`` (a whole sequence) after ``head``, which it must start with."""
    n = len(head)
    if spec.student is not None:
        raise ProtocolError(f"seqs[{index}]: a job of student sequences carries no prefix")
    if spec.messages is not None or spec.text is not None or len(spec.tokens) < n:
        raise ProtocolError(f"seqs[{index}] does not start with the job's prefix")
    if spec.tokens[:n] != head:
        raise ProtocolError(f"seqs[{index}] does not start with the job's prefix")
    return spec.tokens[n:]
