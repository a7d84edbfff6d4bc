"""A teacher with its own tokenizer: where the student's and the teacher's tokens of one
completion cut it at the same places, and the teacher's log-prob of each span between.

Everything is in UTF-8 bytes of the completion. ``byte_spans`` turns a fast tokenizer's
character offsets into byte spans; ``cut_points`` finds where a token sequence may be cut (a
token that covers part of a character, as byte-level BPE makes of an emoji, shares its
character's span with its neighbours, so no cut falls inside it; a token with an empty span
joins the token after it); ``align`` keeps the cuts both sides share: each run between two
shared cuts is a span of whole student tokens and whole teacher tokens. ``span_arrays`` sums the
teacher's token log-probs over each run.

Naive equivalent: for every byte position ``p``, ``p`` is a shared cut when some student token
and some teacher token both start (or the text ends) exactly at ``p`` and no teacher token
crosses ``p``; the run's log-prob is ``sum(teacher_logps[c:d])`` over its teacher tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from worker.errors import BadRequest

__all__ = ["Alignment", "align", "byte_spans", "cut_points", "span_arrays"]


@dataclass(frozen=True)
class Alignment:
    """One completion's alignment: each teacher token's ``[start, end)`` bytes, and per run
    its student token range ``[a, b)`` and teacher token range ``[c, d)``."""

    teacher_spans: np.ndarray  # [n_t, 2] int32
    span_student: np.ndarray  # [n_r, 2] int32
    span_teacher: np.ndarray  # [n_r, 2] int32


def byte_spans(text: str, char_offsets: Sequence[Sequence[int]]) -> np.ndarray:
    """``[n, 2]`` int64 byte spans of ``text`` from ``[n, 2]`` character offsets."""
    ends = np.cumsum([0, *(len(ch.encode()) for ch in text)])  # [chars + 1] byte of each char
    offsets = np.asarray(char_offsets, dtype=np.int64).reshape(-1, 2)
    if offsets.size and (offsets.min() < 0 or offsets.max() > len(text)):
        raise BadRequest("the tokenizer's offsets fall outside the completion")
    return ends[offsets]


def cut_points(spans: np.ndarray, size: int) -> dict[int, int]:
    """Byte position -> index of the first token after it, for every place the tokens with
    byte ``spans`` ``[n, 2]`` may be cut, 0 and ``size`` included (``{0: 0, size: n}``)."""
    n = len(spans)
    cuts = {0: 0}
    if n > 1:
        reach = np.maximum.accumulate(spans[:, 1])[:-1]  # [n-1] furthest end before each cut
        floor = np.minimum.accumulate(spans[::-1, 0])[::-1][1:]  # [n-1] nearest start after
        for i in np.flatnonzero(reach <= floor):
            cuts.setdefault(int(floor[i]), int(i) + 1)  # an empty token joins the next one
    cuts = {p: i for p, i in cuts.items() if 0 <= p < size}
    cuts[size] = n
    return cuts


def align(student_cuts: Sequence[int], teacher_spans: np.ndarray, size: int) -> Alignment:
    """The runs of a completion of ``size`` bytes: ``student_cuts`` (``n_s + 1`` increasing byte
    positions, 0 to ``size``), the teacher tokens' byte ``spans``."""
    if len(teacher_spans) == 0:
        raise BadRequest("the teacher's tokenizer gives no tokens for the completion")
    teacher = cut_points(teacher_spans, size)
    student = {p: i for i, p in enumerate(student_cuts)}
    shared = sorted(set(teacher) & set(student))
    a = np.array(shared[:-1]), np.array(shared[1:])
    span_student = np.stack([[student[p] for p in a[0]], [student[p] for p in a[1]]], axis=1)
    span_teacher = np.stack([[teacher[p] for p in a[0]], [teacher[p] for p in a[1]]], axis=1)
    return Alignment(
        teacher_spans=np.asarray(teacher_spans, dtype=np.int32),
        span_student=span_student.astype(np.int32),
        span_teacher=span_teacher.astype(np.int32),
    )


def span_arrays(alignment: Alignment, ids: np.ndarray, logps: np.ndarray) -> dict[str, np.ndarray]:
    """The result arrays of one aligned completion (``worker.protocol.student.STUDENT_ARRAYS``):
    its teacher ``ids`` ``[n_t]`` and spans, and per run the sum of ``logps`` ``[n_t]`` (in
    float64, returned float32) with its student and teacher ranges."""
    sums = np.concatenate([[0.0], np.cumsum(np.asarray(logps, dtype=np.float64))])  # [n_t + 1]
    lo, hi = alignment.span_teacher[:, 0], alignment.span_teacher[:, 1]
    return {
        "teacher_ids": np.asarray(ids, dtype=np.int32),
        "teacher_spans": alignment.teacher_spans,
        "span_logps": (sums[hi] - sums[lo]).astype(np.float32),
        "span_student": alignment.span_student,
        "span_teacher": alignment.span_teacher,
    }
