"""Completion-only, vocab-chunked token log-probabilities.

The fast path takes the backbone's hidden states at the scored positions only and pushes them
through the LM head in chunks of ``chunk_tokens`` rows, reducing each ``[chunk, V]`` block with a
float32 logsumexp done in place. Peak extra memory is one ``[chunk, V]`` float32 block instead of
the ``[B, T, V]`` logits plus a second ``[B, T, V]`` log_softmax that in-trainer code allocates.

Naive equivalent (TRL ``selective_log_softmax`` / verl ``logprobs_from_logits``)::

    torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, labels[..., None])

``naive_token_logps`` below is exactly that, and the tests assert the two agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class LogitTransform:
    """Model-specific edits a ``*ForCausalLM.forward`` applies to the LM-head output.

    ``scale`` multiplies (Cohere ``logit_scale``), ``divisor`` divides (Granite ``logits_scaling``),
    ``softcap`` applies ``cap * tanh(x / cap)`` (Gemma 2/3 ``final_logit_softcapping``), in that
    order.
    """

    scale: float | None = None
    divisor: float | None = None
    softcap: float | None = None

    @property
    def identity(self) -> bool:
        """True when the transform does nothing."""
        return self.scale is None and self.divisor is None and self.softcap is None

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """Apply in place to float32 ``logits`` ``[N, V]`` and return them."""
        if self.scale is not None:
            logits.mul_(self.scale)
        if self.divisor is not None:
            logits.div_(self.divisor)
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits


def logit_transform_for(model: nn.Module) -> LogitTransform:
    """The ``LogitTransform`` a transformers causal LM applies after its LM head (its config)."""
    config: Any = getattr(model, "config", None)
    if config is None:
        return LogitTransform()

    def num(name: str) -> float | None:
        value = getattr(config, name, None)
        return (
            float(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool)
            else None
        )

    scale = num("logit_scale")
    divisor = num("logits_scaling")
    softcap = num("final_logit_softcapping")
    return LogitTransform(
        scale=None if scale in (None, 1.0) else scale,
        divisor=None if divisor in (None, 1.0) else divisor,
        softcap=softcap if softcap else None,
    )


def naive_token_logps(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Reference: ``log_softmax(logits.float() / T).gather(-1, labels)``, ``[..., V] -> [...]``."""
    logps = torch.log_softmax(logits.float() / temperature, dim=-1)  # [..., V]
    return logps.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # [...]


def chunked_token_logps(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    transform: LogitTransform | None = None,
) -> torch.Tensor:
    """Log-prob of ``labels`` under ``head(hidden)``, ``chunk_tokens`` rows at a time, in float32.

    ``hidden``: ``[N, H]`` hidden states of the positions that predict ``labels`` ``[N]``.
    Returns ``[N]`` float32. Naive equivalent:
    ``naive_token_logps(transform(head(hidden)), labels, temperature)``.
    """
    return chunked_rows(
        hidden,
        labels,
        lambda h, y, t: _block_logps(h, head, y, temperature, t),
        temperature=temperature,
        chunk_tokens=chunk_tokens,
        transform=transform,
    )


BlockLogps = Callable[[torch.Tensor, torch.Tensor, LogitTransform], torch.Tensor]
"""One chunk's log-probs: ``(hidden [n, H], labels [n], transform) -> [n]`` float32."""


def chunked_rows(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    block: BlockLogps,
    *,
    temperature: float,
    chunk_tokens: int,
    transform: LogitTransform | None,
) -> torch.Tensor:
    """Checked inputs, then ``block`` over ``chunk_tokens`` rows at a time: ``[N]`` float32.
    The loop of ``chunked_token_logps`` and ``tiles.tiled_token_logps``."""
    if hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"hidden has {hidden.shape[0]} rows but labels has {labels.shape[0]}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    transform = transform or LogitTransform()
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # [N]
    for lo in range(0, hidden.shape[0], max(1, chunk_tokens)):
        hi = min(lo + chunk_tokens, hidden.shape[0])
        out[lo:hi] = block(hidden[lo:hi], labels[lo:hi], transform)
    return out


def _block_logps(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    temperature: float,
    transform: LogitTransform,
) -> torch.Tensor:
    """One chunk: ``[n, H]`` -> ``[n]``; the only ``[n, V]`` buffer is reused in place."""
    logits = head(hidden)  # [n, V] model dtype
    # A head returns a fresh tensor, so the in-place ops below are safe; float() is a no-op
    # for float32 heads and a single [n, V] copy for half-precision ones.
    logits = logits.float()
    transform.apply_(logits)
    if temperature != 1.0:
        logits.div_(temperature)
    picked = logits.gather(1, labels[:, None]).squeeze(1)  # [n]
    peak = logits.amax(dim=1, keepdim=True)  # [n, 1]
    total = logits.sub_(peak).exp_().sum(dim=1)  # [n]
    return picked - peak.squeeze(1) - total.log()  # [n]
