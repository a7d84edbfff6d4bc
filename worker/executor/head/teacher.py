"""Teacher outputs for distillation: per scored position, more than the actual token's log-prob.

A job names the arrays it wants in a ``TokenOutputs`` spec (torch-free, in
``worker.scorer.teacher``, re-exported here); ``chunked_token_outputs`` pushes the
hidden states of the scored positions through the LM head a byte-budgeted ``[c, V]`` block at a
time and reduces every requested output inside the block, so no ``[n_scored, V]`` tensor is ever
built. Every output is computed on the logits ``logps`` uses: model transform (softcap/scale),
then ``/ temperature``, in float32.

======================  =====================  ==============================================
output                  arrays (per position)  naive equivalent, ``lp = log_softmax(logits)``
======================  =====================  ==============================================
``logps``               ``logps`` f32          ``lp.gather(-1, labels)``
``entropy``             ``entropy`` f32        ``-(lp.exp() * lp).sum(-1)``
``topk``                ``topk_ids`` i32 [k],  ``lp.topk(k)``;
                        ``topk_logps`` f32 [k] ``log1p(-topk_logps.exp().sum(-1))``
                        ``topk_tail_logp`` f32
``gather``              ``gather_logps`` [K]   ``lp.gather(-1, ids)`` (ids [n, K] or shared [K])
``processed_logps``     ``processed_logps``    see ``worker.executor.head.sampling``
``rank``                ``rank`` i32           ``(lp >= lp.gather(-1, labels)).sum(-1)``
======================  =====================  ==============================================

The tail is summed directly over the tokens outside the top k (no ``1 - sum`` cancellation) and is
``-inf`` when the top k hold all the mass. ``rank`` compares the logits (``lp`` and the logits
differ by one constant per row, so the order is the same); it needs the whole row at once, so a
job asking for it runs the block path (never the vocabulary tiles).
"""

from __future__ import annotations

import torch
from torch import nn

from worker.errors import BadRequest
from worker.executor.head.logprobs import LogitTransform
from worker.executor.head.sampling import masked_support, processed_logps, sorted_support
from worker.executor.head.tiles import tileable, tiled_token_outputs
from worker.scorer.teacher import (
    MAX_GATHER_IDS,
    MAX_TOPK,
    OUTPUT_NAMES,
    Sampling,
    TokenOutputs,
    result_bytes,
)

__all__ = [
    "BASE_UNITS",
    "DEFAULT_BUDGET_BYTES",
    "FAST_UNITS",
    "MAX_GATHER_IDS",
    "MAX_TOPK",
    "OUTPUT_NAMES",
    "SORT_UNITS",
    "Sampling",
    "TokenOutputs",
    "block_units",
    "chunk_rows_for",
    "chunked_token_outputs",
    "result_bytes",
]

DEFAULT_BUDGET_BYTES = 128 * 1024 * 1024
"""Per-block budget: with V = 128,256 that is 261 rows without a sampler (174 from a
half-precision head), 104 with a top-k / min-p sampler, 40 with a top-p sort, on any device."""

BASE_UNITS = 2.5
"""``[c, V]`` float32 blocks held at once with a sampler that needs no sort (top-k / min-p): the
logits, their exp, and 0.5 of slack for a bool mask (0.25) or a half-precision head output
before its float32 copy (0.5)."""
FAST_UNITS = 1.0
"""Without a sampler the exp is taken in place: one ``[c, V]`` float32 block (the logits, then
their exp); plus ``HALF_HEAD_UNITS`` when the head's output is half precision (its ``[c, V]``
output lives beside the float32 copy)."""
HALF_HEAD_UNITS = 0.5
RANK_UNITS = 0.25
"""``rank``'s ``z >= z_label`` comparison: a ``[c, V]`` bool block beside the logits."""
SORT_UNITS = 6.5
"""With a sort (the exp block is freed first): the logits plus, while sorting, the sorted values
and their int64 indices (4 blocks; measured 4.03 on CPU, whose sort also keeps a row or two of
scratch per thread). CUDA's segmented sort also reads an int64 iota (2 more blocks; estimated,
not measured), and 0.5 of slack."""


def block_units(spec: TokenOutputs, vocab: int, half_head: bool = True) -> float:
    """``[c, V]`` float32 blocks one chunk holds at its peak: ``FAST_UNITS`` (+
    ``HALF_HEAD_UNITS`` for a half-precision head) without a sampler, else ``BASE_UNITS`` or
    ``SORT_UNITS``."""
    if spec.sampling is None:
        rank = RANK_UNITS if "rank" in spec.outputs else 0.0
        return FAST_UNITS + (HALF_HEAD_UNITS if half_head else 0.0) + rank
    if spec.sampling.needs_sort(vocab):
        return SORT_UNITS
    return BASE_UNITS


def chunk_rows_for(vocab: int, budget_bytes: int, units: float = BASE_UNITS) -> int:
    """Rows per block so that ``rows * vocab * 4 * units <= budget_bytes`` (at least 1 row).

    Naive equivalent: one block of all rows (``[N, V]``), no budget.
    """
    if vocab < 1 or budget_bytes < 1 or units <= 0:
        raise ValueError(
            f"need vocab, budget_bytes, units > 0; got {vocab}, {budget_bytes}, {units}"
        )
    return max(1, int(budget_bytes // (vocab * 4 * units)))


def chunked_token_outputs(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    spec: TokenOutputs,
    *,
    transform: LogitTransform | None = None,
    gather_ids: torch.Tensor | None = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    chunk_rows: int | None = None,
    vocab_tile: int = 0,
    native_ok: bool = True,
) -> dict[str, torch.Tensor]:
    """The arrays ``spec`` asks for at ``N`` scored positions, one byte-budgeted block at a time.

    ``hidden`` ``[N, H]`` predicts ``labels`` ``[N]``; ``gather_ids`` ``[N, K]`` are per-position
    ids (with ``spec.gather_width`` K). ``chunk_rows`` overrides the budget's rows. With
    ``vocab_tile``, a spec without a sampler and a plain linear head, the blocks are ``[rows,
    vocab_tile]`` slices reduced with a running logsumexp (``tiles.tiled_token_outputs``; the
    rows are then ``chunk_rows``, 1,024 by default; ``native_ok`` lets the compiled kernel of
    ``native.py`` fold them). Returns float32
    arrays (int32 ``topk_ids``) on ``hidden``'s device, keyed as in the module table; ``logps``
    equals ``chunked_token_logps``. Naive equivalent: the table's formulas on
    ``log_softmax(transform(head(hidden)).float() / T)`` over all N rows at once.
    """
    n = hidden.shape[0]
    if labels.shape != (n,):
        raise ValueError(f"hidden has {n} rows but labels has shape {tuple(labels.shape)}")
    vocab = _vocab_of(head, hidden)
    spec.check_vocab(vocab)
    per_row_ids = _per_position_ids(gather_ids, spec, n, vocab, hidden.device)  # [N, K] | None
    shared_ids = torch.tensor(spec.gather_ids, dtype=torch.long, device=hidden.device)  # [K]
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    units = block_units(spec, vocab)
    out = _allocate(spec, n, hidden.device)
    transform = transform or LogitTransform()
    if vocab_tile and spec.sampling is None and "rank" not in spec.outputs and tileable(head):
        ids = per_row_ids if per_row_ids is not None else shared_ids  # [N, K] | [K]
        with torch.inference_mode():
            return tiled_token_outputs(
                hidden,
                head,  # type: ignore[arg-type]
                labels,
                spec,
                gather_ids=ids,
                out=out,
                chunk_tokens=chunk_rows or chunk_rows_for(vocab_tile, budget_bytes, units),
                tile=vocab_tile,
                transform=transform,
                native_ok=native_ok,
            )
    rows = chunk_rows or chunk_rows_for(vocab, budget_bytes, units)
    with torch.inference_mode():
        # One exp block for every chunk: a fresh [c, V] per chunk costs its page faults again on
        # CPU (measured 3.4x the exp itself). The sort path frees its exp instead (SORT_UNITS);
        # without a sampler the exp is taken in place (FAST_UNITS).
        exp_buf = None
        if n and units == BASE_UNITS:
            exp_buf = torch.empty(min(rows, n), vocab, dtype=torch.float32, device=hidden.device)
        for lo in range(0, n, rows):
            hi = min(lo + rows, n)
            ids = per_row_ids[lo:hi] if per_row_ids is not None else shared_ids  # [c, K] | [K]
            e = None if exp_buf is None else exp_buf[: hi - lo]  # [c, V]
            block = _block_outputs(hidden[lo:hi], head, labels[lo:hi], spec, transform, ids, e)
            for name, value in block.items():
                out[name][lo:hi] = value
    return out


def _vocab_of(head: nn.Module, hidden: torch.Tensor) -> int:
    """V from the head's ``out_features`` or, failing that, from one row through it."""
    vocab = getattr(head, "out_features", None)
    if isinstance(vocab, int):
        return vocab
    with torch.inference_mode():
        return int(head(hidden[:1]).shape[-1])


def _per_position_ids(
    ids: torch.Tensor | None, spec: TokenOutputs, n: int, vocab: int, device: torch.device
) -> torch.Tensor | None:
    """Validated per-position gather ids as int64 ``[N, K]`` on ``device`` (None when shared)."""
    if not spec.gather_width:
        if ids is not None:
            raise BadRequest("per-position gather ids given but the request has no gather_width")
        return None
    if ids is None:
        raise BadRequest(f"the request needs per-position gather ids of shape [{n}, K]")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise BadRequest(f"gather ids must be integers, got {ids.dtype}")
    if tuple(ids.shape) != (n, spec.gather_width):
        raise BadRequest(
            f"gather ids have shape {tuple(ids.shape)}, expected [{n}, {spec.gather_width}]"
        )
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise BadRequest(f"gather ids must be in 0..{vocab - 1}")
    return ids.to(device=device, dtype=torch.long)


def _allocate(spec: TokenOutputs, n: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Empty result arrays for ``n`` positions, in the order of ``OUTPUT_NAMES``."""

    def f32(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32, device=device)

    out: dict[str, torch.Tensor] = {}
    if "logps" in spec.outputs:
        out["logps"] = f32(n)  # [N]
    if "entropy" in spec.outputs:
        out["entropy"] = f32(n)  # [N]
    if "topk" in spec.outputs:
        out["topk_ids"] = torch.empty(n, spec.topk, dtype=torch.int32, device=device)  # [N, k]
        out["topk_logps"] = f32(n, spec.topk)  # [N, k]
        out["topk_tail_logp"] = f32(n)  # [N]
    if "gather" in spec.outputs:
        out["gather_logps"] = f32(n, spec.gather_k)  # [N, K]
    if "processed_logps" in spec.outputs:
        out["processed_logps"] = f32(n)  # [N]
    if "rank" in spec.outputs:
        out["rank"] = torch.empty(n, dtype=torch.int32, device=device)  # [N]
    return out


def _block_outputs(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    spec: TokenOutputs,
    transform: LogitTransform,
    ids: torch.Tensor,
    e: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """One block ``[c, H]`` -> the requested ``[c, ...]`` arrays; see ``block_units`` for memory.
    ``e``: a ``[c, V]`` float32 block to hold ``exp(z)`` (None: a fresh one) when a sampler
    needs ``z`` and ``exp(z)`` side by side; without a sampler the exp is taken in place."""
    want = spec.outputs
    z = head(hidden).float()  # [c, V] a fresh tensor, so in place is safe
    transform.apply_(z)
    if spec.temperature != 1.0:
        z.div_(spec.temperature)
    z.sub_(z.amax(dim=1, keepdim=True))  # [c, V] logits - rowmax, as chunked_token_logps
    z_label = z.gather(1, labels[:, None]).squeeze(1)  # [c]
    rank = None
    if "rank" in want:  # 1-based: tokens at least as likely as the label, the label included
        rank = (z >= z_label[:, None]).sum(dim=1).to(torch.int32)  # [c]
    top = z.topk(spec.topk, dim=1) if "topk" in want else None  # [c, k] values desc, ids
    picked = None
    if ids.numel():
        picked = z.index_select(1, ids) if ids.dim() == 1 else z.gather(1, ids)  # [c, K]
    if spec.sampling is None:
        fast = _in_place_outputs(z, z_label, top, picked, want)
        if rank is not None:
            fast["rank"] = rank
        return fast
    # -inf logits (a masking head) would make exp(z) * z NaN; clamp after the exact reads above.
    z.clamp_(min=torch.finfo(z.dtype).min)
    e = torch.exp(z, out=e) if e is not None else z.exp()  # [c, V]
    total = e.sum(dim=1)  # [c]
    log_total = total.log()  # [c]
    out: dict[str, torch.Tensor] = {}
    if "logps" in want:
        out["logps"] = z_label - log_total  # [c]
    if "entropy" in want:
        dot = torch.bmm(e[:, None, :], z[:, :, None]).view(-1)  # [c] sum(exp(z) * z), no [c, V]
        out["entropy"] = log_total - dot / total  # [c]
    if top is not None:
        out["topk_ids"] = top.indices.to(torch.int32)  # [c, k]
        out["topk_logps"] = top.values - log_total[:, None]  # [c, k]
        kept = e.gather(1, top.indices)  # [c, k]
        tail = e.scatter_(1, top.indices, 0.0).sum(dim=1)  # [c] mass outside the top k
        out["topk_tail_logp"] = tail.log() - log_total  # [c] -inf when the top k hold it all
        e.scatter_(1, top.indices, kept)  # restore for the sampler
    if picked is not None:
        out["gather_logps"] = picked - log_total[:, None]  # [c, K]
    if spec.sampling is not None:
        if spec.sampling.needs_sort(z.shape[1]):
            del e  # the sort path holds its own blocks
            thr, mass = sorted_support(z, spec.sampling)  # [c], [c]
        else:
            thr, mass = masked_support(z, e, spec.sampling)  # [c], [c]
        out["processed_logps"] = processed_logps(z_label, thr, mass)  # [c]
    if rank is not None:
        out["rank"] = rank
    return out


def _in_place_outputs(
    z: torch.Tensor,
    z_label: torch.Tensor,
    top: torch.return_types.topk | None,
    picked: torch.Tensor | None,
    want: frozenset[str],
) -> dict[str, torch.Tensor]:
    """The outputs of a block without a sampler, ``z`` (``logits - rowmax`` ``[c, V]``, already
    read for the label, top-k and gather) turned into ``exp(z)`` in place: one ``[c, V]`` block
    (``FAST_UNITS``), as ``chunked_token_logps``, whose ``logps`` these equal bit for bit.
    ``sum(exp(z) * z)`` is taken as ``sum(xlogy(e, e))``: ``log(exp(z)) = z`` to rounding, and
    an underflowed or ``-inf`` logit adds 0 (no NaN, no clamp pass)."""
    e = z.exp_()  # [c, V] the logits' block, now exp(z)
    total = e.sum(dim=1)  # [c]
    log_total = total.log()  # [c]
    out: dict[str, torch.Tensor] = {}
    if "logps" in want:
        out["logps"] = z_label - log_total  # [c]
    kept = None
    if top is not None:
        out["topk_ids"] = top.indices.to(torch.int32)  # [c, k]
        out["topk_logps"] = top.values - log_total[:, None]  # [c, k]
        kept = e.gather(1, top.indices)  # [c, k]
        tail = e.scatter_(1, top.indices, 0.0).sum(dim=1)  # [c] mass outside the top k
        out["topk_tail_logp"] = tail.log() - log_total  # [c] -inf when the top k hold it all
    if picked is not None:
        out["gather_logps"] = picked - log_total[:, None]  # [c, K]
    if "entropy" in want:
        dot = torch.special.xlogy(e, e, out=e).sum(dim=1)  # [c] sum(exp(z) * z) outside the top k
        if kept is not None:
            dot += torch.special.xlogy(kept, kept).sum(dim=1)  # [c] and inside it
        out["entropy"] = log_total - dot / total  # [c]
    return out
