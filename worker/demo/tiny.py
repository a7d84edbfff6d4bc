"""Tiny checkpoints to try the worker with: ``scoring-worker demo --save-models DIR``.

``save_tiny_models(DIR)`` writes two random Llama checkpoints that load like any other, each
with the same byte-level tokenizer (UTF-8 bytes are ids 3..258; ``<unk>`` 0, ``<s>`` 1, ``</s>``
2) and a chat template, so ``text`` and ``messages`` inputs work too:

* ``DIR/tiny-llama``: a ``LlamaForCausalLM`` (reference log-probs, teacher outputs);
* ``DIR/tiny-reward``: a ``LlamaForSequenceClassification`` with one label (rewards).

Their scores mean nothing (random weights, seed 0); they load in well under a second on a CPU,
which is what docs, tests and first tries need.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

BYTE_OFFSET = 3
"""Token id of byte 0 (ids 0-2 are ``<unk>``, ``<s>``, ``</s>``), as ``samples.ByteTokenizer``."""

VOCAB_SIZE = 256 + BYTE_OFFSET

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
"""A minimal chat template: each message as ``<s>role\\ncontent</s>\\n``."""


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet (each byte as one printable character), as byte-level BPE
    tokenizers spell bytes."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def byte_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` over UTF-8 bytes (no merges), with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab = {**specials, **{ch: b + BYTE_OFFSET for b, ch in _bytes_to_unicode().items()}}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<unk>",
    )  # fmt: skip
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(**overrides: Any) -> Any:
    """The ``LlamaConfig`` of both checkpoints (2 layers, hidden 64, 4 heads, 2 KV heads)."""
    from transformers import LlamaConfig

    values: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    return LlamaConfig(**{**values, **overrides})


def save_tiny_models(directory: str | Path) -> dict[str, Path]:
    """Write ``tiny-llama`` and ``tiny-reward`` under ``directory``; their paths by name."""
    import torch
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    root = Path(directory)
    tokenizer = byte_tokenizer()
    out = {"tiny-llama": root / "tiny-llama", "tiny-reward": root / "tiny-reward"}
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config()).save_pretrained(out["tiny-llama"])
    torch.manual_seed(1)
    LlamaForSequenceClassification(tiny_config(num_labels=1)).save_pretrained(out["tiny-reward"])
    for path in out.values():
        tokenizer.save_pretrained(path)
    return out


__all__ = ["CHAT_TEMPLATE", "VOCAB_SIZE", "byte_tokenizer", "save_tiny_models", "tiny_config"]
