"""``StudentView``: a sequence as a student with another tokenizer sees it, for a teacher that
tokenizes the text its own way (``docs/distillation.md``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from worker.errors import BadRequest
from worker.request.checks import integer


@dataclass(frozen=True)
class StudentView:
    """A sequence as a student with another tokenizer sees it (docs/distillation.md): the
    prompt as ``prompt`` text or ``messages`` (the teacher's chat template renders them); the
    completion as the student's ``tokens`` (strings that spell ``completion``, if given), or
    ``completion`` and ``offsets``, each token's start in UTF-8 bytes (0 first, increasing)."""

    completion: str = ""
    tokens: tuple[str, ...] | None = None
    offsets: tuple[int, ...] | None = None
    prompt: str | None = None
    messages: tuple[Any, ...] | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None) or (
            self.prompt is not None and not isinstance(self.prompt, str)
        ):
            raise BadRequest("student: give exactly one of prompt (a string) and messages")
        if self.messages is not None:
            object.__setattr__(self, "messages", _listed("messages", self.messages))
        if (self.tokens is None) == (self.offsets is None) or not isinstance(self.completion, str):
            raise BadRequest("student: give tokens (strings), or a completion and its offsets")
        if self.tokens is not None:
            tokens = _listed("tokens", self.tokens)
            if not all(isinstance(t, str) and t for t in tokens):
                raise BadRequest("student.tokens must be non-empty strings")
            spelled, given = "".join(tokens), self.completion
            if given and spelled != given:
                raise BadRequest(f"student.tokens spell {spelled[:60]!r}..., not the completion")
            object.__setattr__(self, "tokens", tokens)
            object.__setattr__(self, "completion", spelled)
        else:
            end = max(len(self.completion.encode()) - 1, 0)
            raw = _listed("offsets", self.offsets)
            offsets = tuple(integer("student.offsets[i]", o, 0, end) for o in raw)
            if offsets[0] or any(b <= a for a, b in itertools.pairwise(offsets)):
                raise BadRequest("student.offsets must start at 0 and increase strictly")
            object.__setattr__(self, "offsets", offsets)
        if not self.completion:
            raise BadRequest("student: the completion is empty")

    def cuts(self) -> list[int]:
        """Byte positions where student tokens start, then the completion's end (``n + 1``)."""
        if self.offsets is not None:
            return [*self.offsets, len(self.completion.encode())]
        return [0, *itertools.accumulate(len(t.encode()) for t in self.tokens or ())]


def _listed(name: str, value: Any, most: int = 65536) -> tuple[Any, ...]:
    """``value`` (a list) as a tuple of 1..``most`` items; else ``BadRequest``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise BadRequest(f"student.{name} must be a list")
    out = tuple(value)
    integer(f"number of student.{name}", len(out), 1, most)
    return out


# -- teacher outputs
