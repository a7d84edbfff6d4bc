"""Sample rollouts for ``scoring-worker demo``: prompts with a plausible and an implausible
completion, so a real model's log-probs visibly prefer the first."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

SAMPLES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("The capital of France is", (" Paris.", " Berlin.")),
    ("Two plus two equals", (" four.", " seven.")),
    ("The sun rises in the", (" east.", " west.")),
    ("Water freezes at zero degrees", (" Celsius.", " Kelvin.")),
    ("def add(a, b):\n    return", (" a + b", " a * b")),
)


@dataclass(frozen=True)
class SampleRollout:
    """A prompt and one completion, tokenized; the completion starts at ``prompt_len``."""

    prompt: str
    completion: str
    tokens: list[int]
    prompt_len: int

    def as_seq(self) -> dict[str, Any]:
        """The sequence map the client takes."""
        return {"tokens": self.tokens, "prompt_len": self.prompt_len}


class ByteTokenizer:
    """UTF-8 bytes as token ids (offset 3, id 1 = BOS): for the random fallback model only."""

    vocab_size = 259
    bos_token_id = 1

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS)."""
        return [b + 3 for b in text.encode("utf-8")]


def encoder_for(tokenizer: Any) -> Callable[[str], list[int]]:
    """A ``text -> ids`` function for a transformers tokenizer or ``ByteTokenizer``."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode
    return lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_samples(
    tokenizer: Any, samples: Sequence[tuple[str, Sequence[str]]] = SAMPLES
) -> list[list[SampleRollout]]:
    """One group per prompt (one rollout per completion). Prompt and completion are tokenized
    separately and concatenated, so the scored tokens are exactly the completion's; a BOS token
    is prepended when the tokenizer has one (the first token is never scored)."""
    encode = encoder_for(tokenizer)
    bos = getattr(tokenizer, "bos_token_id", None)
    groups = []
    for prompt, completions in samples:
        head = ([bos] if bos is not None else []) + encode(prompt)
        group = []
        for completion in completions:
            tail = encode(completion)
            group.append(SampleRollout(prompt, completion, head + tail, len(head)))
        groups.append(group)
    return groups
