"""Exact per-sequence attention over tree rows, as a transformers attention function.

``tree_attention`` is registered with transformers' ``AttentionInterface`` as ``scoring_tree``;
``tree_backend`` switches the models to it for one forward (no mask is built for a name
transformers does not know: ``masking_utils`` hands the layers ``attention_mask=None``), and the
layout arrives as the ``scoring_tree`` keyword of ``model(...)``. Per layer, in the math
``layout.kernel`` names:

* ``flex`` (the ``flex_attention`` backend): one flex call over the whole rows with a
  ``BlockMask`` (``block_mask``, built once per forward and window): query ``q`` sees key ``k``
  when ``k``'s segment is ``q``'s or a node above it, ``k <= q`` in the row, and the two are
  within the window in positions (``visible``). The nodes' K/V are read in place, tiles no
  query sees are skipped.
* ``sdpa`` / ``eager``: every segment (a shared node or a continuation) in blocks of like sizes:
  its queries ``[n, H, C, D]`` against the keys of the nodes above it (its context, gathered:
  their K/V duplicated per segment, a chunk of segments at a time) followed by its own keys,
  causal within the segment (``_gathered``). A root node has no context: on SDPA without a
  window that is the causal kernel.

All honour what the model's own attention does: ``scaling``, GQA, sliding windows in positions
(``q - k < window``, as ``masking_utils.sliding_window_overlay``), logit softcapping (Gemma-2; a
``score_mod`` in flex, else eager math, as its models do) and attention sinks (gpt-oss,
``s_aux``: eager math on every kernel; flex would need its log-sum-exp to add them).
Any other argument, a non-causal module, or a call without a layout raises ``TreeUnsupported``:
the runner then serves the sequences one by one. Naive equivalent: each sequence alone through
the model's own attention; the tests assert the two agree.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.executor import backends
from worker.executor.tree.rows import Block, TreeLayout

NAME = "scoring_tree"
# transient bytes of one chunk of continuations (their duplicated prefix K/V and scores)
_CHUNK_BYTES = 256 * 1024 * 1024
# flex tiles (query and key tokens; torch's default) and query-key pairs per step of block_mask
_BLOCK = 128
_MASK_SLOTS = 1 << 23  # about 10 transient bytes each
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
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    if layout.kernel == "flex" and s_aux is None:
        out = _flex(
            query, key, value, layout, scale=scale, window=sliding_window, softcap=softcap,
            training=module.training,
        )  # fmt: skip
        return out, None
    opts: dict[str, Any] = {
        "scaling": scale,
        "softcap": softcap,
        "sinks": s_aux,
        "eager": layout.kernel == "eager" or softcap is not None or s_aux is not None,
    }
    return _gathered(query, key, value, layout, sliding_window, opts), None


def _gathered(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: TreeLayout,
    window: int | None,
    opts: dict[str, Any],
) -> torch.Tensor:
    """The SDPA/eager math of the module docstring: per block of segments, the context K/V
    gathered per segment; ``query`` ``[R, H, T, D]`` -> ``[R, T, H, D]``."""
    rows, heads, width, dim = query.shape
    groups = heads // key.shape[1]
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
            plain = a == 0 and window is None and not opts["eager"]
            mask = None if plain else _segment_mask(block, part, window)  # [n, 1, C, A + C]
            got = _attend(qc, kc, vc, mask, **opts).transpose(1, 2)  # [n, C, H, D]
            cols = torch.arange(c, device=own.device)  # [C]
            valid = cols[None, :] < block.own_len[part][:, None]  # [n, C]
            out.index_copy_(0, own[valid], got[valid])
    return out.view(rows, width, heads, dim)


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


def visible(
    seg_q: torch.Tensor,
    pos_q: torch.Tensor,
    q_idx: torch.Tensor,
    seg_k: torch.Tensor,
    end_k: torch.Tensor,
    pos_k: torch.Tensor,
    kv_idx: torch.Tensor,
    window: torch.Tensor,
) -> torch.Tensor:
    """Whether key ``kv_idx`` (segment ``seg_k`` whose subtree ends at ``end_k``, position
    ``pos_k``) is seen by query ``q_idx`` (``seg_q``, ``pos_q``) of one row (``layout`` module
    docstring): its segment is the query's or above it, it is not later in the row, and it is
    inside the sliding ``window`` in positions (broadcasting tensors; fill tokens see nothing
    and are seen by nothing)."""
    mine = (seg_k <= seg_q) & (seg_q < end_k) & (kv_idx <= q_idx)
    return mine & (pos_q - pos_k < window)


def _maps(layout: TreeLayout, padded: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``seg``, ``seg_end``, ``positions`` ``[R, padded]``: fill past the row's width (what a
    kernel may read for the slots of its last block)."""
    extra = padded - layout.width
    return (
        F.pad(layout.seg, (0, extra), value=-1),
        F.pad(layout.seg_end, (0, extra), value=-1),
        F.pad(layout.positions, (0, extra), value=0),
    )


def _limit(window: int | None, device: torch.device) -> torch.Tensor:
    """The window as a 0-d tensor (no window: no limit), so every window runs one mask code."""
    value = torch.iinfo(torch.int64).max if window is None else int(window)
    return torch.tensor(value, dtype=torch.int64, device=device)


def dense_mask(
    layout: TreeLayout, window: int | None, first: int = 0, last: int | None = None
) -> torch.Tensor:
    """Which keys the queries ``first .. last - 1`` of every row see, ``[R, last - first, P]``
    (``P``: the width rounded up to the flex block; slots past the width see nothing)."""
    padded = -(-layout.width // _BLOCK) * _BLOCK
    last = padded if last is None else last
    seg, end, pos = _maps(layout, padded)  # [R, P] each
    device = seg.device
    q_idx = torch.arange(first, last, device=device)  # [Q]
    kv_idx = torch.arange(padded, device=device)  # [P]
    return visible(
        seg[:, first:last, None], pos[:, first:last, None], q_idx[None, :, None],
        seg[:, None, :], end[:, None, :], pos[:, None, :], kv_idx[None, None, :],
        _limit(window, device),
    )  # fmt: skip


def block_mask(layout: TreeLayout, window: int | None) -> Any:
    """The flex ``BlockMask`` of ``layout`` under ``window`` (cached on the layout: every layer
    with that window reads the same). Its block lists come from ``dense_mask``, ``_MASK_SLOTS``
    query-key pairs at a time: a ``_BLOCK`` x ``_BLOCK`` tile is skipped when no pair of it is
    visible, and runs without the mask when every pair is; its ``mask_mod`` is ``visible``."""
    if window in layout.masks:
        return layout.masks[window]
    from torch.nn.attention.flex_attention import BlockMask

    rows, width = layout.seg.shape
    padded = -(-width // _BLOCK) * _BLOCK
    tiles = padded // _BLOCK
    step = max(1, _MASK_SLOTS // (rows * padded * _BLOCK)) * _BLOCK
    some, every = [], []
    for first in range(0, padded, step):
        last = min(first + step, padded)
        dense = dense_mask(layout, window, first, last)  # [R, Q, P]
        tile = dense.view(rows, (last - first) // _BLOCK, _BLOCK, tiles, _BLOCK)
        some.append(tile.any(dim=4).any(dim=2))  # [R, Q / B, P / B]
        every.append(tile.all(dim=4).all(dim=2))
    full = torch.cat(every, dim=1)  # [R, P / B, P / B]
    partial = torch.cat(some, dim=1) & ~full
    seg, end, pos = _maps(layout, padded)  # [R, P] each
    limit = _limit(window, seg.device)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> Any:
        # tensors and indices only: a Python int of the shape here would be compiled in as a
        # constant, and every new width would compile flex again
        return visible(seg[b, q], pos[b, q], q, seg[b, k], end[b, k], pos[b, k], k, limit)

    mask = BlockMask.from_kv_blocks(
        *_ordered(partial), *_ordered(full), BLOCK_SIZE=_BLOCK, mask_mod=mask_mod,
        seq_lengths=(width, width),
    )  # fmt: skip
    layout.masks[window] = mask
    return mask


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, Qb, Kb]`` bool tiles -> a ``BlockMask``'s ``(num_blocks [R, 1, Qb], indices
    [R, 1, Qb, Kb])``: each query tile's key tiles, the chosen ones first (int32)."""
    dense = tiles.to(torch.int32)
    num = dense.sum(dim=-1, dtype=torch.int32)  # [R, Qb]
    idx = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return num[:, None].contiguous(), idx[:, None].contiguous()


def _flex(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: TreeLayout,
    *,
    scale: float,
    window: int | None,
    softcap: float | None,
    training: bool,
) -> torch.Tensor:
    """Tree attention as one flex call per layer over the whole rows (``block_mask``): the
    nodes' K/V read in place, tiles nobody sees skipped. Called as transformers'
    ``flex_attention_forward`` calls it (GQA by ``enable_gqa`` unless the local head count is not
    a power of two, softcap as a ``score_mod``), through the same function: compiled once on
    CUDA, torch's uncompiled reference math on a CPU (``worker.executor.flex``: the compiled CPU
    kernel is wrong on AVX2-only CPUs), so a tree row and a sequence alone run the same math.
    ``query`` ``[R, H, T, D]`` -> ``[R, T, H, D]`` (fill slots: zeros, as a query that sees no
    key gets in flex)."""
    from transformers.integrations import flex_attention as hf_flex

    from worker.executor import flex

    flex.install()
    heads = query.shape[1]
    gqa = heads & (heads - 1) == 0
    if not gqa:
        key = _repeat_kv(key, heads // key.shape[1])
        value = _repeat_kv(value, heads // value.shape[1])
    score_mod = None
    if softcap is not None:
        cap = float(softcap)

        def score_mod(score: torch.Tensor, b: Any, h: Any, q: Any, k: Any) -> torch.Tensor:
            return torch.tanh(score / cap) * cap

    out = hf_flex.compile_friendly_flex_attention(
        query, key, value, score_mod=score_mod, block_mask=block_mask(layout, window),
        enable_gqa=gqa, scale=scale, training=training,
    )  # fmt: skip
    assert isinstance(out, torch.Tensor)  # no auxiliary outputs asked for
    return out.transpose(1, 2).contiguous()  # [R, T, H, D]


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
