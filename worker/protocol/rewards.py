"""Reward inputs on the wire (additive to v1): a sequence's ``messages`` (rendered by the worker
with the reward model's own chat template) or ``text`` (an already-templated string the worker
tokenizes as given), per-sequence ``step_positions``, and the job's ``step`` map (process
rewards).

``messages``: an array of maps, each with a ``role`` and a ``content`` str (other keys pass
through to the template). ``text``: a non-empty str, tokenized by the serving model's own
tokenizer with ``add_special_tokens=False`` (what TRL's and OpenRLHF's reward models do with the
templated text). A sequence carries at most one of the two. A ``reward`` sequence may carry
``messages`` or ``text`` alone (no ``tokens``, ``prompt_len`` or ``mask``); in ``both`` mode
``tokens`` (+ ``prompt_len``/``mask``) are still needed for the log-probs. ``step``:
``{tag_id?: int, label_token_ids?: [good, bad], positive_index?: 0|1}``, mode ``reward`` only;
without ``tag_id`` every sequence gives ``step_positions`` (int32 bin or an array of ints,
strictly increasing).
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from worker.errors import BadRequest, ProtocolError
from worker.protocol.seqs import SeqSpec, as_int32_array, le_bytes
from worker.request import StepOptions

MAX_MESSAGES = 1024


#: The ``step`` map's type is the request vocabulary's (``worker.request.StepOptions``).
StepSpec = StepOptions


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_messages(messages: Any, where: str) -> tuple[dict[str, Any], ...]:
    """``messages`` as a tuple of maps with a ``role`` and a ``content`` string."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ProtocolError(f"{where}.messages must be a non-empty array of {{role, content}} maps")
    if len(messages) > MAX_MESSAGES:
        raise ProtocolError(f"{where}.messages has more than {MAX_MESSAGES} messages")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping) or not all(isinstance(key, str) for key in m):
            raise ProtocolError(f"{where}.messages[{k}] must be a map with string keys")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ProtocolError(f"{where}.messages[{k}].role must be a non-empty string")
        if not isinstance(m.get("content"), str):
            raise ProtocolError(f"{where}.messages[{k}].content must be a string")
        out.append(dict(m))
    return tuple(out)


def as_step_positions(value: Any, where: str) -> array:
    """``step_positions`` as ``array('i')``: >= 0, strictly increasing (range is checked by the
    worker against the reward model's tokens)."""
    try:
        pos = as_int32_array(value)
    except ProtocolError as exc:
        raise ProtocolError(f"{where}.step_positions: {exc.message}") from None
    if any(p < 0 for p in pos) or any(b <= a for a, b in itertools.pairwise(pos)):
        raise ProtocolError(f"{where}.step_positions must be >= 0 and strictly increasing")
    return pos


def check_text(text: Any, where: str) -> str:
    """``text`` as a non-empty str."""
    if not isinstance(text, str) or not text:
        raise ProtocolError(f"{where}.text must be a non-empty string")
    return text


def messages_only(seq: Mapping[str, Any]) -> bool:
    """A sequence map with ``messages`` or ``text`` and no ``tokens`` (the worker tokenizes)."""
    return (seq.get("messages") is not None or seq.get("text") is not None) and seq.get(
        "tokens"
    ) is None


def untokenized(spec: SeqSpec) -> bool:
    """Whether the worker tokenizes this sequence for the reward model (``messages``/``text``)."""
    return spec.messages is not None or spec.text is not None


def with_reward_inputs(spec: SeqSpec, seq: Mapping[str, Any], index: int) -> SeqSpec:
    """``spec`` plus the map's ``messages`` / ``text`` / ``step_positions``, checked."""
    where = f"seqs[{index}]"
    messages = seq.get("messages")
    text = seq.get("text")
    steps = seq.get("step_positions")
    if messages is None and text is None and steps is None:
        return spec
    if messages is not None and text is not None:
        raise ProtocolError(f"{where}: give messages or text, not both")
    return replace(
        spec,
        messages=check_messages(messages, where) if messages is not None else None,
        text=check_text(text, where) if text is not None else None,
        step_positions=as_step_positions(steps, where) if steps is not None else None,
    )


def reward_seq(seq: Mapping[str, Any], index: int) -> SeqSpec:
    """A ``messages``- or ``text``-only sequence (no tokens, no prompt_len, no mask)."""
    if seq.get("prompt_len") is not None or seq.get("mask") is not None:
        raise ProtocolError(f"seqs[{index}]: prompt_len/mask need tokens")
    return with_reward_inputs(SeqSpec(tokens=array("i")), seq, index)


def reward_entry(spec: SeqSpec) -> dict[str, Any]:
    """The wire keys of ``spec``'s reward inputs."""
    entry: dict[str, Any] = {}
    if spec.messages is not None:
        entry["messages"] = [dict(m) for m in spec.messages]
    if spec.text is not None:
        entry["text"] = spec.text
    if spec.step_positions is not None:
        entry["step_positions"] = le_bytes(spec.step_positions)
    return entry


def decode_step(raw: Any) -> StepOptions | None:
    """The job's ``step`` map, checked (``None`` when absent)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ProtocolError("step must be a map {tag_id, label_token_ids, positive_index}")
    unknown = set(raw) - {"tag_id", "label_token_ids", "positive_index"}
    if unknown:
        raise ProtocolError(f"step has unknown keys {sorted(map(str, unknown))}")
    try:
        return StepOptions(
            tag_id=raw.get("tag_id"),
            label_token_ids=raw.get("label_token_ids"),
            positive_index=raw.get("positive_index", 1),
        )
    except BadRequest as exc:
        raise ProtocolError(exc.message) from None


def encode_step(step: StepOptions | Mapping[str, Any] | None) -> dict[str, Any]:
    """``{"step": {...}}`` for a job body (``{}`` without a step)."""
    if step is None:
        return {}
    if isinstance(step, Mapping):
        step = decode_step(step)
    assert step is not None
    body: dict[str, Any] = {"positive_index": step.positive_index}
    if step.tag_id is not None:
        body["tag_id"] = step.tag_id
    if step.label_token_ids is not None:
        body["label_token_ids"] = list(step.label_token_ids)
    return {"step": body}


def check_reward_job(mode: str, seqs: tuple[SeqSpec, ...] | list[SeqSpec], step: Any) -> None:
    """Mode rules: ``messages``/``text`` in ``reward``/``both`` only, a ``messages``- or
    ``text``-only sequence in ``reward`` only, ``step`` in ``reward`` only and with ``tag_id``
    or every sequence's ``step_positions``."""
    for i, s in enumerate(seqs):
        what = "messages" if s.messages is not None else "text"
        if untokenized(s) and mode == "reference":
            raise ProtocolError(f"seqs[{i}]: {what} are scored by a reward model (mode "
                                "reward or both)")  # fmt: skip
        if untokenized(s) and not len(s.tokens) and mode != "reward":
            raise ProtocolError(f"seqs[{i}]: mode {mode} needs tokens for the log-probs")
        if s.step_positions is not None and step is None:
            raise ProtocolError(f"seqs[{i}]: step_positions need a step map on the job")
    if step is None:
        return
    if mode != "reward":
        raise ProtocolError("a step job needs mode 'reward'")
    if step.tag_id is None and any(s.step_positions is None for s in seqs):
        raise ProtocolError("step needs tag_id, or step_positions on every sequence")
