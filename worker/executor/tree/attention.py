"""Exact per-sequence attention over tree rows, as a transformers attention function.

``tree_attention`` is registered with transformers' ``AttentionInterface`` as ``scoring_tree``;
``tree_backend`` switches the models to it for one forward (no mask is built for a name
transformers does not know: ``masking_utils`` hands the layers ``attention_mask=None``), and the
layout arrives as the ``scoring_tree`` keyword of ``model(...)``. Per layer,

every segment (a shared node or a continuation, ``layout``) in blocks of like sizes: its queries
``[n, H, C, D]`` against the keys of the nodes above it (its context, gathered: their K/V
duplicated per segment, a chunk of segments at a time) followed by its own keys, causal within
the segment. A root node has no context: on SDPA without a window that is the causal kernel.

Both honour what the model's own attention does: ``scaling``, GQA (``repeat_kv``), sliding windows
in positions (``q - k < window``, as ``masking_utils.sliding_window_overlay``), logit softcapping
(Gemma-2) and attention sinks (gpt-oss, ``s_aux``), on torch SDPA or in eager math
(``layout.kernel``; softcap and sinks always take the eager math, as their models do). Any other
argument, a non-causal module, or a call without a layout raises ``TreeUnsupported``: the runner
then serves the sequences one by one. Naive equivalent: each sequence alone through the model's
own attention; the tests assert the two agree.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.executor import backends
from worker.executor.tree.layout import Block, TreeLayout

NAME = "scoring_tree"
# transient bytes of one chunk of continuations (their duplicated prefix K/V and scores)
_CHUNK_BYTES = 256 * 1024 * 1024
# keywords the models pass that change nothing here (None/False values of any keyword too)
_INERT = frozenset(
    {"position_ids", "use_cache", "cache_position", "output_attentions", "position_embeddings"}
)


class TreeUnsupported(RuntimeError):
    """The model's attention asked for something the tree path does not reproduce exactly."""


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, Hkv, L, D]`` -> ``[B, Hkv * groups, L, D]`` (transformers' ``repeat_kv``)."""
    if groups == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    *,
    scaling: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
    eager: bool,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, Q, D]`` over ``k``/``v`` ``[B, H, K, D]`` where ``allowed``
    ``[B, 1, Q, K]`` (bool; ``None``: causal, SDPA only); returns ``[B, H, Q, D]``. Eager math
    mirrors transformers' ``eager_attention_forward`` (and gpt-oss's, with sinks); else torch SDPA
    with a bool mask, or its causal kernel."""
    if not eager:
        causal = allowed is None
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, is_causal=causal, scale=scaling
        )
    assert allowed is not None
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling  # [B, H, Q, K]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)  # [B, H, Q, 1]
        both = torch.cat([scores, sink.to(scores.dtype)], dim=-1)  # [B, H, Q, K + 1]
        both = both - both.max(dim=-1, keepdim=True).values
        probs = F.softmax(both, dim=-1, dtype=both.dtype)[..., :-1]
    else:
        probs = F.softmax(scores, dim=-1, dtype=torch.float32)
    return torch.matmul(probs.to(v.dtype), v)  # [B, H, Q, D]


def _windowed(allowed: torch.Tensor, gap: torch.Tensor, window: int | None) -> torch.Tensor:
    """``allowed`` where the query-key position ``gap`` is inside a sliding ``window``."""
    return allowed if window is None else allowed & (gap < window)


def tree_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    scoring_tree: TreeLayout | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Per-sequence attention over tree rows (module docstring). ``query`` ``[R, H, T, D]``,
    ``key``/``value`` ``[R, Hkv, T, D]``; returns ``([R, T, H, D], None)`` as transformers'
    attention functions do (rows' fill slots come back as zeros, never read)."""
    layout = scoring_tree
    if layout is None:
        raise TreeUnsupported("tree attention called without a tree layout")
    odd = sorted(k for k, v in kwargs.items() if k not in _INERT and v not in (None, False))
    if odd:
        raise TreeUnsupported(f"attention arguments the tree path does not reproduce: {odd}")
    if attention_mask is not None or dropout or not getattr(module, "is_causal", True):
        raise TreeUnsupported("attention with a mask, dropout or not causal")
    layout.windows.append(sliding_window)
    rows, heads, width, dim = query.shape
    scale = float(scaling) if scaling is not None else dim**-0.5
    groups = heads // key.shape[1]
    opts: dict[str, Any] = {
        "scaling": scale,
        "softcap": softcap,
        "sinks": s_aux,
        "eager": layout.kernel == "eager" or softcap is not None or s_aux is not None,
    }
    out = query.new_zeros(rows * width, heads, dim)  # [R * T, H, D]
    flat_q = query.transpose(1, 2).reshape(rows * width, heads, dim)  # [R * T, H, D]
    flat_k = key.transpose(1, 2).reshape(rows * width, key.shape[1], dim)  # [R * T, Hkv, D]
    flat_v = value.transpose(1, 2).reshape(rows * width, key.shape[1], dim)
    for block in layout.blocks:
        n, c = block.own.shape
        a = block.ctx.shape[1]
        per = (a + c) * heads * (2 * dim * query.element_size() + 4 * c)  # bytes per segment
        step = max(1, _CHUNK_BYTES // per)
        for first in range(0, n, step):
            part = slice(first, first + step)
            own, ctx = block.own[part], block.ctx[part]  # [n, C], [n, A]
            keys = torch.cat([ctx, own], dim=1)  # [n, A + C]
            qc = flat_q[own].transpose(1, 2)  # [n, H, C, D]
            kc = _repeat_kv(flat_k[keys].transpose(1, 2), groups)  # [n, H, A + C, D]
            vc = _repeat_kv(flat_v[keys].transpose(1, 2), groups)
            plain = a == 0 and sliding_window is None and not opts["eager"]
            mask = None if plain else _segment_mask(block, part, sliding_window)  # [n, 1, C, A+C]
            got = _attend(qc, kc, vc, mask, **opts).transpose(1, 2)  # [n, C, H, D]
            cols = torch.arange(c, device=own.device)  # [C]
            valid = cols[None, :] < block.own_len[part][:, None]  # [n, C]
            out.index_copy_(0, own[valid], got[valid])
    return out.view(rows, width, heads, dim), None


def _segment_mask(block: Block, part: slice, window: int | None) -> torch.Tensor:
    """Which keys ``[context (A columns), own tokens (C)]`` each query of the segments ``part``
    may see, ``[n, 1, C, A + C]``: the real context tokens and its own earlier tokens, within
    ``window`` positions (positions: context column ``i`` is position ``i``, own column ``j`` is
    ``ctx_len + j``)."""
    ctx_len = block.ctx_len[part]  # [n]
    n, c = block.own[part].shape
    a = block.ctx.shape[1]
    cols_a = torch.arange(a, device=ctx_len.device)  # [A]
    cols_c = torch.arange(c, device=ctx_len.device)  # [C]
    qpos = ctx_len[:, None] + cols_c[None, :]  # [n, C]
    kpos = torch.cat([cols_a.expand(n, a), qpos], dim=1)  # [n, A + C]
    gap = qpos[:, :, None] - kpos[:, None, :]  # [n, C, A + C]
    real = torch.cat([cols_a[None, :] < ctx_len[:, None], qpos >= 0], dim=1)  # [n, A + C]
    own = torch.cat([cols_a < 0, cols_c >= 0])  # [A + C] own-token columns
    causal = torch.where(own[None, None, :], gap >= 0, real[:, None, :])  # [n, C, A + C]
    return _windowed(causal, gap, window)[:, None]


def register() -> None:
    """Register ``tree_attention`` as ``scoring_tree`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, tree_attention)


@contextmanager
def tree_backend(models: Sequence[nn.Module]) -> Iterator[None]:
    """Run a block with ``models`` on ``scoring_tree`` (their configs restored exactly after).
    The caller holds the models alone (``BackendGate.exclusive``): other forwards would read the
    switched configs."""
    register()
    with ExitStack() as stack:
        for model in models:
            stack.enter_context(backends.temporary_backend(model, NAME))
        yield


def refusal(model: nn.Module) -> str | None:
    """Why ``model``'s architecture cannot run tree rows exactly (``None``: it may; the load
    check still compares): layers other than softmax attention, ALiBi biases (by row index)."""
    config: Any = getattr(model, "config", None)
    kinds = set(getattr(config, "layer_types", None) or ())
    other = sorted(kinds - {"full_attention", "sliding_attention", "attention"})
    if other:
        return f"{type(model).__name__} has non-attention layers {other} (linear attention)"
    if getattr(config, "attention_chunk_size", None):
        return f"{type(model).__name__} uses chunked attention (applied by its mask)"
    if getattr(config, "alibi", False) or getattr(config, "model_type", "") in _ALIBI:
        return f"{type(model).__name__} uses ALiBi position biases (by row index)"
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__} does not route attention through AttentionInterface"
    return None


_ALIBI = frozenset({"bloom", "mpt", "baichuan"})
