"""A teacher with its own tokenizer: the student's view of a sequence (``StudentView``: its
prompt and its completion as text) tokenized with the served model's tokenizer, at intake.

``tokenize_student`` renders the prompt (``messages`` with the chat template and its generation
prompt, or ``prompt`` as given), tokenizes the completion alone with the fast tokenizer's offset
mapping, and aligns the two tokenizations (``worker.scorer.align``): the ids the forward scores
and where the student's and the teacher's tokens cut the completion alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from worker.errors import BadRequest
from worker.executor.rewards.chat import check_messages, has_template
from worker.request import SequenceInput, StudentView, TokenOutputs
from worker.scorer.align import align, byte_spans

__all__ = ["students", "tokenize_student"]


def _prompt_ids(tokenizer: Any, view: StudentView) -> list[int]:
    if view.messages is None:
        return list(tokenizer(view.prompt, add_special_tokens=False)["input_ids"])
    if not has_template(tokenizer):
        raise BadRequest("the teacher's tokenizer has no chat template: send the prompt as text")
    try:
        out = tokenizer.apply_chat_template(
            check_messages(list(view.messages)), tokenize=True, add_generation_prompt=True
        )
    except Exception as exc:  # jinja TemplateError, ...
        raise BadRequest(f"the teacher's chat template refused messages: {exc}") from None
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def tokenize_student(tokenizer: Any, view: StudentView) -> SequenceInput:
    """The sequence the teacher scores for ``view``: its prompt's and completion's ids (the
    completion scored) and the alignment (``SequenceInput.aligned``)."""
    if tokenizer is None:
        raise BadRequest("this worker's model carries no tokenizer: send token ids")
    if not getattr(tokenizer, "is_fast", False):
        raise BadRequest("the teacher's tokenizer has no offset mapping (not a fast tokenizer)")
    prompt = _prompt_ids(tokenizer, view)
    if not prompt:
        raise BadRequest("the prompt gives no teacher tokens: the first token is never scored")
    enc = tokenizer(view.completion, add_special_tokens=False, return_offsets_mapping=True)
    spans = byte_spans(view.completion, enc["offset_mapping"])
    alignment = align(view.cuts(), spans, len(view.completion.encode()))
    ids = np.asarray([*prompt, *enc["input_ids"]], dtype=np.int64)
    return SequenceInput(tokens=ids, prompt_len=len(prompt), student=view, aligned=alignment)


def students(
    tokenizer: Any, seqs: Sequence[SequenceInput], spec: TokenOutputs, mode: str = "reference"
) -> list[SequenceInput]:
    """``seqs`` with every student view tokenized (errors name the sequence); student
    sequences are scored in mode ``reference``, their outputs need ``logps`` (the spans sum
    them) and take no per-position gather ids."""
    if not any(getattr(s, "student", None) is not None for s in seqs):
        return list(seqs)
    if mode != "reference":
        raise BadRequest(f"student sequences are scored in mode reference, not {mode!r}")
    if "logps" not in spec.outputs:
        raise BadRequest("student sequences need 'logps' among the outputs (spans sum them)")
    if spec.gather_width:
        raise BadRequest("student sequences take shared gather_ids only (teacher ids)")
    out = []
    for i, seq in enumerate(seqs):
        if seq.student is None or seq.aligned is not None:
            out.append(seq)
            continue
        try:
            out.append(tokenize_student(tokenizer, seq.student))
        except BadRequest as exc:
            raise BadRequest(f"sequence {i}: {exc.message}") from None
    return out
