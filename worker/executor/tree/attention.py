"""Exact per-sequence attention over a tree row, as a transformers attention function.

``tree_attention`` is registered with transformers' ``AttentionInterface`` as ``scoring_tree``;
``tree_backend`` switches the models to it for one forward (no mask is built for a name
transformers does not know: ``masking_utils`` hands the layers ``attention_mask=None``), and the
layout arrives as the ``scoring_tree`` keyword of ``model(...)``. Two blocks per layer:

- the prefixes: ``[R, H, P, D]`` queries against their own keys, causal (the sequence alone);
- the continuations: each one's queries ``[N, H, C, D]`` against its row's prefix keys followed by
  its own keys (the prefix K/V duplicated per continuation), causal within the continuation.

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
from worker.executor.tree.layout import TreeLayout

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
    # prefixes: causal over the prefix region (pads sit after every real prefix token)
    p = layout.prefix_width
    idx = torch.arange(p, device=query.device)  # [P]
    gap = idx[:, None] - idx[None, :]  # [P, P] query - key position
    allowed: torch.Tensor | None = _windowed(gap >= 0, gap, sliding_window)[None, None]
    if sliding_window is None and not opts["eager"]:
        allowed = None  # SDPA's causal kernel, no mask tensor; else [1, 1, P, P]
    kp = _repeat_kv(key[:, :, :p], groups)  # [R, H, P, D]
    vp = _repeat_kv(value[:, :, :p], groups)
    pre = _attend(query[:, :, :p], kp, vp, allowed, **opts)  # [R, H, P, D]
    out.view(rows, width, heads, dim)[:, :p] = pre.transpose(1, 2)
    # continuations, a chunk at a time: their row's prefix keys, then their own keys
    flat_q = query.transpose(1, 2).reshape(rows * width, heads, dim)  # [R * T, H, D]
    flat_k = key.transpose(1, 2).reshape(rows * width, key.shape[1], dim)  # [R * T, Hkv, D]
    flat_v = value.transpose(1, 2).reshape(rows * width, key.shape[1], dim)
    n, c = layout.cont_index.shape
    per = (p + c) * heads * (2 * dim * query.element_size() + 4 * c)  # bytes per continuation
    step = max(1, _CHUNK_BYTES // per)
    for a in range(0, n, step):
        part = slice(a, a + step)
        index, row = layout.cont_index[part], layout.cont_row[part]  # [n, C], [n]
        qc = flat_q[index].transpose(1, 2)  # [n, H, C, D]
        kc = torch.cat([key[row, :, :p], flat_k[index].transpose(1, 2)], dim=2)  # [n, Hkv, P+C, D]
        vc = torch.cat([value[row, :, :p], flat_v[index].transpose(1, 2)], dim=2)
        kc, vc = _repeat_kv(kc, groups), _repeat_kv(vc, groups)  # [n, H, P + C, D]
        mask = _continuation_mask(layout, part, p, sliding_window)  # [n, 1, C, P + C]
        cont = _attend(qc, kc, vc, mask, **opts).transpose(1, 2)  # [n, C, H, D]
        valid = layout.cont_valid[part]  # [n, C]
        out.index_copy_(0, index[valid], cont[valid])
    return out.view(rows, width, heads, dim), None


def _continuation_mask(layout: TreeLayout, part: slice, p: int, window: int | None) -> torch.Tensor:
    """Which keys ``[row prefix (P columns), own continuation (C)]`` each query of the
    continuations ``part`` may see, ``[n, 1, C, P + C]``: its row's real prefix tokens and its own
    earlier tokens, within ``window`` positions."""
    qpos = layout.cont_positions()[part]  # [n, C]
    n, c = qpos.shape
    cols = torch.arange(p + c, device=qpos.device)  # [P + C]
    kpos = torch.cat([cols[:p].expand(n, p), qpos], dim=1)  # [n, P + C]
    own = cols[None, :] >= p  # [1, P + C] continuation keys
    real = cols[None, :] < layout.prefix_lens[layout.cont_row[part]][:, None]  # [n, P + C]
    gap = qpos[:, :, None] - kpos[:, None, :]  # [n, C, P + C]
    causal = torch.where(own[:, None, :], gap >= 0, (~own & real)[:, None, :])  # [n, C, P + C]
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
