"""Conversations and text in: a sequence's ``messages`` rendered with the reward model's own
tokenizer and chat template, its ``text`` tokenized as given, and whether two tokenizers give
token ids the same meaning.

``render`` is what ``tokenizer.apply_chat_template(messages, tokenize=True)`` returns, and
``encode`` what ``tokenizer(text, add_special_tokens=False)["input_ids"]`` returns (the text is
already templated: TRL's model rewards tokenize ``prompt + completion`` so), each as an int64
array; the executor calls them at intake (``Scorer.prepare``), not in the forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from worker.errors import BadRequest


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """``messages`` as a list of dicts, each with a ``role`` and a ``content`` string;
    ``BadRequest`` for any other shape."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise BadRequest(
            f"messages must be a list of {{role, content}} maps, got {type(messages).__name__}"
        )
    if not messages:
        raise BadRequest("messages is empty")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise BadRequest(f"messages[{k}] must be a {{role, content}} map")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise BadRequest(f"messages[{k}].role must be a non-empty string")
        if not isinstance(content, str):
            raise BadRequest(f"messages[{k}].content must be a string")
        out.append(dict(m))
    return out


def has_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template."""
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def render(tokenizer: Any, messages: Any) -> np.ndarray:
    """The reward model's token ids ``[L]`` int64 for ``messages``: its chat template applied
    (``apply_chat_template(messages, tokenize=True)``). ``BadRequest`` for a bad shape, a
    tokenizer without a chat template, or a template that refuses the conversation."""
    checked = check_messages(messages)
    if tokenizer is None:
        raise BadRequest("the reward model's checkpoint carries no tokenizer: send tokens")
    if not has_template(tokenizer):
        raise BadRequest("the reward model's tokenizer has no chat template: send tokens")
    try:
        out = tokenizer.apply_chat_template(checked, tokenize=True)
    except Exception as exc:  # jinja TemplateError (e.g. "roles must alternate"), ...
        raise BadRequest(f"the reward model's chat template refused messages: {exc}") from None
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size == 0:
        raise BadRequest("the chat template rendered messages to no tokens")
    return arr


def encode(tokenizer: Any, text: Any) -> np.ndarray:
    """The reward model's token ids ``[L]`` int64 for an already-templated ``text``:
    ``tokenizer(text, add_special_tokens=False)["input_ids"]`` (no BOS/EOS added: the text holds
    what it needs). ``BadRequest`` when the worker has no tokenizer or the text gives no tokens."""
    if not isinstance(text, str) or not text:
        raise BadRequest("text must be a non-empty string")
    if tokenizer is None:
        raise BadRequest(
            "this worker's model carries no tokenizer, so it cannot tokenize text: send tokens"
        )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size == 0:
        raise BadRequest("the text tokenizes to no tokens")
    return arr


def same_vocabulary(a: Any, b: Any) -> bool | None:
    """Whether two tokenizers map every token to the same id (``None``: one is missing)."""
    if a is None or b is None:
        return None
    if a is b:
        return True
    return bool(a.get_vocab() == b.get_vocab())
