"""The student's view on the wire (additive to v1): a sequence scored by a teacher with its own
tokenizer carries ``student`` instead of ``tokens`` (docs/protocol.md, *Student text*).

``student`` is a map: ``prompt`` (str, tokenized as given) or ``messages`` (an array of
``{role, content}`` maps, rendered with the worker's chat template and its generation prompt);
``tokens`` (an array of the student's token strings, which spell the completion) or
``offsets`` (int32 LE bin or an array of ints: the UTF-8 byte offset where each student token
starts) with ``completion`` (str; optional beside ``tokens``, then checked against them). The
values are checked by ``worker.request.StudentView``; a refusal is ``bad_request``.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Any

from worker.errors import BadRequest, ProtocolError
from worker.protocol.rewards import check_messages
from worker.protocol.seqs import SeqSpec, as_int32_array, le_bytes
from worker.request import StudentView

__all__ = ["STUDENT_ARRAYS", "student_entry", "student_only", "student_seq", "student_view"]

_KEYS = ("prompt", "messages", "completion", "tokens", "offsets")
STUDENT_ARRAYS: dict[str, tuple[str, int]] = {
    "teacher_ids": ("<i4", 1),
    "teacher_spans": ("<i4", 2),
    "span_logps": ("<f4", 1),
    "span_student": ("<i4", 2),
    "span_teacher": ("<i4", 2),
}
"""The arrays a result carries per student sequence besides the teacher outputs: per teacher
token its id and ``[start, end)`` bytes in the completion; per aligned span its log-prob, its
student token range ``[a, b)`` and its teacher token range ``[c, d)``."""


def student_only(seq: Mapping[str, Any]) -> bool:
    """A sequence map with ``student`` (the worker tokenizes it)."""
    return seq.get("student") is not None


def student_view(raw: Any, where: str) -> StudentView:
    """The ``student`` map of a sequence as a ``StudentView``, checked."""
    if isinstance(raw, StudentView):
        return raw
    if not isinstance(raw, Mapping) or not set(raw) <= set(_KEYS):
        raise ProtocolError(f"{where}.student must be a map with keys among {_KEYS}")
    messages = raw.get("messages")
    if messages is not None:
        messages = check_messages(messages, f"{where}.student")
    offsets = raw.get("offsets")
    if offsets is not None:
        try:
            offsets = tuple(as_int32_array(offsets))
        except ProtocolError as exc:
            raise ProtocolError(f"{where}.student.offsets: {exc.message}") from None
    tokens = raw.get("tokens")
    if tokens is not None and not isinstance(tokens, (list, tuple)):
        raise ProtocolError(f"{where}.student.tokens must be an array of strings")
    try:
        return StudentView(
            completion=raw.get("completion") or "",
            tokens=tuple(tokens) if tokens is not None else None,
            offsets=offsets,
            prompt=raw.get("prompt"),
            messages=messages,
        )
    except BadRequest as exc:
        raise ProtocolError(f"{where}: {exc.message}") from None


def student_seq(seq: Mapping[str, Any], index: int) -> SeqSpec:
    """A ``student`` sequence (no ``tokens``, ``prompt_len``, ``mask`` or ``gather_ids``)."""
    where = f"seqs[{index}]"
    for key in ("tokens", "prompt_len", "mask", "gather_ids", "messages", "text"):
        if seq.get(key) is not None:
            raise ProtocolError(f"{where}: a student sequence carries no {key}")
    return SeqSpec(tokens=array("i"), student=student_view(seq["student"], where))


def student_entry(spec: SeqSpec) -> dict[str, Any]:
    """The wire keys of ``spec``'s student view (``{}`` without one)."""
    view = spec.student
    if view is None:
        return {}
    body: dict[str, Any] = {"completion": view.completion}
    if view.prompt is not None:
        body["prompt"] = view.prompt
    else:
        body["messages"] = [dict(m) for m in view.messages or ()]
    if view.tokens is not None:
        body["tokens"] = list(view.tokens)
    else:
        body["offsets"] = le_bytes(array("i", view.offsets or ()))
    return {"student": body}
