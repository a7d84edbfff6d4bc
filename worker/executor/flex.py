"""``flex_attention`` on a CPU runs torch's uncompiled math, never the compiled CPU kernel.

transformers' ``flex_attention_forward`` calls ``compile_friendly_flex_attention``, which runs
``torch.compile(flex_attention)`` on every device. On a CPU that compiles torch inductor's C++
flex template, and torch 2.13's template is wrong on CPUs without AVX-512 (an AMD EPYC with AVX2
only, 2026-12-05): for a key length that is an odd multiple of 8 (8, 24, 40, ...) its output
differs from SDPA by up to 2 and is sometimes NaN, different from run to run (memory read before
it is written), with or without a mask; lengths 16 and 32 are right. ``install`` routes every CPU
call of that function to the eager ``flex_attention`` (torch's dense reference math: every score
materialised, exact on any CPU) and leaves CUDA calls on the compiled kernel. It is installed
when a model is switched to ``flex_attention`` (``backends.switch_backend``) and by the tree
attention's flex kernel, so both sides of the tree load check (per sequence and tree rows) run
the same math. Naive equivalent: ``torch.nn.functional.scaled_dot_product_attention`` with the
same mask; ``tests/executor/test_flex.py`` asserts the two agree at every length.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_LOCK = threading.Lock()
_MARK = "_scoring_cpu_eager"


def _eager_on_cpu(compiled: Any) -> Any:
    """``compiled`` (transformers' ``compile_friendly_flex_attention``) with CPU calls sent to
    the uncompiled ``flex_attention`` (same arguments; ``training`` has no meaning there)."""
    from torch.nn.attention.flex_attention import flex_attention

    def call(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        training: bool = False,
        **kwargs: Any,
    ) -> Any:
        if query.device.type == "cpu":
            return flex_attention(query, key, value, **kwargs)
        return compiled(query, key, value, training=training, **kwargs)

    setattr(call, _MARK, True)
    call.__wrapped__ = compiled  # type: ignore[attr-defined]
    return call


def install() -> None:
    """Route CPU calls of transformers' compiled flex attention to the eager math (idempotent,
    thread-safe; module docstring)."""
    from transformers.integrations import flex_attention as hf_flex

    with _LOCK:
        current = hf_flex.compile_friendly_flex_attention
        if not getattr(current, _MARK, False):
            hf_flex.compile_friendly_flex_attention = _eager_on_cpu(current)


def installed() -> bool:
    """Whether ``install`` has run in this process."""
    from transformers.integrations import flex_attention as hf_flex

    return bool(getattr(hf_flex.compile_friendly_flex_attention, _MARK, False))
