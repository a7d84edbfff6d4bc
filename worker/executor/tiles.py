"""Vocab-tiled LM head: the log-softmax reductions over ``[rows, tile]`` slices of the vocabulary.

On a CPU the ``[rows, V]`` float32 block of ``chunked_token_logps`` is written by the head's
matmul and then read and rewritten by every reduction (transform, max, exp, sum): with V = 128,256
and a few hundred rows it is over 100 MB, so each pass goes to main memory. Here the head's weight
is cut into tiles of ``tile`` vocabulary rows; each ``[rows, tile]`` slice of the logits is made by
its own matmul and reduced while it sits in cache, with a running (online) logsumexp::

    m' = max(m, max(z_tile))
    s' = s * exp(m - m') + sum(exp(z_tile - m'))
    logp(label) = z_label - (m + log s)

so no pass over the logits touches main memory and a block holds ``rows * tile`` floats (4 MiB at
1,024 x 1,024) whatever the vocabulary. The matmuls add up to the same FLOPs as one. Only a plain
``nn.Linear`` head with no hooks is tiled (the slices must be the head's whole computation); the
executor uses it on CPU, where it measured faster than whole-vocabulary blocks, and keeps the
blocks on accelerators, whose one large matmul is the fast path.

Naive equivalent: ``log_softmax(transform(head(hidden)).float() / T).gather(-1, labels)``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from worker.executor.logprobs import LogitTransform, chunked_rows
from worker.scorer.teacher import TokenOutputs

__all__ = [
    "DEFAULT_TILE",
    "OnlineLogSumExp",
    "OnlineTopK",
    "head_tiles",
    "tileable",
    "tiled_token_logps",
    "tiled_token_outputs",
]

DEFAULT_TILE = 1024
"""Vocabulary rows per tile on CPU: a ``[1024, 1024]`` float32 slice is 4 MiB, within a server
core's share of cache; 512 and 2,048 measured within noise of it on SmolLM2 and V = 128,256."""

GROUP = 16
"""Vocabulary ids per group in ``OnlineTopK.candidates``' pre-filter."""

_FLOOR = torch.finfo(torch.float32).min
"""Stand-in for a running max of ``-inf`` (a row whose logits so far are all ``-inf``), so
``exp(m - m')`` and ``z - m'`` never meet ``-inf - (-inf)``."""


def tileable(head: nn.Module | None) -> bool:
    """Whether ``head`` can be cut into vocabulary tiles: exactly ``nn.Linear`` (a weight and an
    optional bias, nothing else), with no (pre-)forward hooks but idle ones (a hook whose ``idle()``
    says it adds nothing in this context, as the LoRA hooks do when the active adapter leaves
    the head alone; any other hook, a LoRA delta on the head for one, must see the whole
    output) and no global module hooks."""
    if type(head) is not nn.Linear:
        return False
    if any(
        getattr(nn.modules.module, name, None)
        for name in ("_global_forward_hooks", "_global_forward_pre_hooks")
    ):
        return False
    hooks = [*head._forward_pre_hooks.values(), *head._forward_hooks.values()]
    return all(_idle(hook) for hook in hooks)


def _idle(hook: object) -> bool:
    idle = getattr(hook, "idle", None)
    return callable(idle) and bool(idle())


def head_tiles(
    hidden: torch.Tensor,
    head: nn.Linear,
    tile: int,
    transform: LogitTransform,
    temperature: float,
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(v0, z)`` for each tile: ``z`` ``[n, t]`` float32 holds ``transform(logits) / T`` of
    vocabulary ids ``v0 .. v0 + t - 1`` (a fresh tensor each time, free to change in place)."""
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    weight, bias = head.weight, head.bias  # [V, H], [V] | None
    vocab = weight.shape[0]
    for v0 in range(0, vocab, tile):
        v1 = min(vocab, v0 + tile)
        z = F.linear(hidden, weight[v0:v1], None if bias is None else bias[v0:v1])  # [n, t]
        z = z.float()  # no-op for a float32 head; a [n, t] copy for a half-precision one
        transform.apply_(z)
        if temperature != 1.0:
            z.div_(temperature)
        yield v0, z


class OnlineLogSumExp:
    """Running ``logsumexp`` over vocabulary tiles, one value per row (float32 ``[n]``).

    ``m`` is the running max (``_FLOOR`` while a row has seen only ``-inf``), ``s`` the sum of
    ``exp(z - m)`` so far. With ``entropy``, ``t`` also keeps ``sum(exp(z - m) * (z - m))``, so
    that at the end ``entropy = log s - t / s`` (``-sum p log p``).
    """

    def __init__(self, n: int, device: torch.device, entropy: bool = False) -> None:
        self.m = torch.full((n,), _FLOOR, dtype=torch.float32, device=device)  # [n]
        self.s = torch.zeros(n, dtype=torch.float32, device=device)  # [n]
        self.t = torch.zeros(n, dtype=torch.float32, device=device) if entropy else None  # [n]
        self.scale = torch.ones(n, dtype=torch.float32, device=device)  # [n] the last rescale
        self._e: torch.Tensor | None = None  # [n * tile] exp buffer (entropy keeps z beside it)

    def add_(self, z: torch.Tensor, row_max: torch.Tensor | None = None) -> torch.Tensor:
        """Fold ``z`` ``[n, t]`` in (overwritten; ``row_max``, its max per row when known);
        returns ``exp(z - m')`` ``[n, t]`` (contiguous): ``z`` itself, or with ``entropy`` a
        buffer reused by the next call."""
        if row_max is None:
            row_max = z.amax(dim=1)  # [n]
        new_m = torch.maximum(self.m, row_max)  # [n] finite: _FLOOR bounds it below
        scale = (self.m - new_m).exp_()  # [n] rescales what was summed against the old max
        z.sub_(new_m[:, None])  # [n, t] z - m'; -inf stays -inf
        if self.t is not None:
            # t' = scale * (t + (m - m') * s) + sum(e * (z - m'))
            self.t.addcmul_(self.m - new_m, self.s).mul_(scale)
            if self._e is None or self._e.numel() < z.numel():
                self._e = torch.empty(z.numel(), dtype=z.dtype, device=z.device)
            e = torch.exp(z, out=self._e[: z.numel()].view(z.shape))  # [n, t] beside z - m'
            dot = z.mul_(e).sum(dim=1)  # [n] sum(e * (z - m')); z is spent
            if bool(dot.isnan().any()):  # a -inf logit: 0 * -inf, which adds 0
                dot = z.nan_to_num_(nan=0.0).sum(dim=1)
            self.t += dot
        else:
            e = z.exp_()  # [n, t]
        self.s.mul_(scale).add_(e.sum(dim=1))
        self.m, self.scale = new_m, scale
        return e

    def lse(self) -> torch.Tensor:
        """``logsumexp`` of everything folded in, ``[n]`` (``-inf`` for an all ``-inf`` row)."""
        return self.m + self.s.log()

    def entropy(self) -> torch.Tensor:
        """``-sum p log p`` per row, ``[n]`` (needs ``entropy=True``)."""
        assert self.t is not None, "OnlineLogSumExp(entropy=True) keeps the entropy sum"
        return self.s.log() - self.t / self.s


def pick_(picked: torch.Tensor, z: torch.Tensor, v0: int, ids: torch.Tensor) -> None:
    """Copy into ``picked`` (``[n]`` or ``[n, K]``) the logits ``z`` ``[n, t]`` (ids ``v0 ..``)
    at ``ids`` (same shape as ``picked``) that fall in this tile; the others keep their value."""
    local = ids - v0  # [n] | [n, K]
    inside = (local >= 0) & (local < z.shape[1])
    if not bool(inside.any()):
        return
    index = local.clamp(0, z.shape[1] - 1)
    got = z.gather(1, index if index.dim() == 2 else index[:, None])  # [n, K] | [n, 1]
    picked.copy_(torch.where(inside, got.view_as(picked), picked))


def tiled_token_logps(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    tile: int = DEFAULT_TILE,
    transform: LogitTransform | None = None,
) -> torch.Tensor:
    """``chunked_token_logps`` with vocabulary tiles: ``[N, H]`` hidden, ``[N]`` labels ->
    ``[N]`` float32 log-probs, ``chunk_tokens`` rows x ``tile`` vocabulary ids at a time.

    Naive equivalent: ``naive_token_logps(transform(head(hidden)), labels, temperature)``.
    """

    def block(rows: torch.Tensor, lab: torch.Tensor, transform: LogitTransform) -> torch.Tensor:
        acc = OnlineLogSumExp(rows.shape[0], rows.device)
        picked = torch.zeros(rows.shape[0], dtype=torch.float32, device=rows.device)  # [n]
        for v0, z in head_tiles(rows, head, tile, transform, temperature):
            pick_(picked, z, v0, lab)  # before add_ overwrites z
            acc.add_(z)
        return picked - acc.lse()

    return chunked_rows(
        hidden,
        labels,
        block,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
        transform=transform,
    )


Found = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""A tile's top-k candidates, flat: rows ``[P]``, logits ``[P]`` and positions in the tile's
flat ``[n * t]`` view ``[P]``."""


class OnlineTopK:
    """Running top ``k`` logits over vocabulary tiles, and the mass outside them.

    ``values`` ``[n, k]`` (descending) and ``ids`` ``[n, k]`` are the best ``k`` logits seen so
    far once ``finish`` ran; ``tail`` ``[n]`` sums ``exp(z - m)`` (``m``, the ``OnlineLogSumExp``
    max) over every other token seen, directly (the tiles' remainders and the candidates a merge
    evicts), with no ``1 - sum(top)`` cancellation.

    ``torch.topk`` over a short row costs ~50x a max, so a tile is not searched with it: the
    tile is cut into ``GROUP`` strided groups (ids ``j, j + t/G, j + 2t/G, ...``: their max is a
    vectorised reduction over the tile's rows), only the groups whose max beats its row's k-th
    best so far (the bar) are read, and their logits above the bar are the candidates. They wait
    in a flat list and are merged (one top-k over each row's kept k and its candidates) once
    they number ``n * k``: after the first tiles the bar is high, a tile brings about
    ``k / tiles seen`` candidates a row, and most tiles cost a few maxima.
    """

    def __init__(self, n: int, k: int, device: torch.device) -> None:
        self.k = k
        self.values = torch.full((n, k), float("-inf"), dtype=torch.float32, device=device)
        self.ids = torch.zeros(n, k, dtype=torch.long, device=device)  # [n, k]
        self.tail = torch.zeros(n, dtype=torch.float32, device=device)  # [n]
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._count = 0
        self.row_max: torch.Tensor | None = None  # [n] the last tile's max, when it was read

    def candidates(self, z: torch.Tensor) -> Found | None:
        """This tile's candidates in the logits ``z`` ``[n, t]`` (before exp, contiguous): a
        superset of the tile's logits that beat the bar, or None when no row has one."""
        n, t = z.shape
        bar = self.values[:, -1]  # [n] the k-th best merged so far (-inf at first)
        self.row_max = None
        if t % GROUP or bool(torch.isneginf(bar).any()):  # ragged tile, or a row not yet full
            return self._dense(z)
        stride = t // GROUP
        gmax = z.view(n, GROUP, stride).amax(dim=1)  # [n, t/G] group j: [:, :, j]
        self.row_max = gmax.amax(dim=1)  # [n] the tile's, for OnlineLogSumExp.add_
        hit = gmax > bar[:, None]  # [n, t/G]
        rows, cols = hit.nonzero(as_tuple=True)  # [P]
        if not rows.numel():
            return None
        if rows.numel() * GROUP > 4 * z.shape[0] * min(self.k, t):  # early tiles: most groups
            return self._dense(z)  # topk is cheaper, and holds [n, k] instead of [P, G]
        flat = z.view(-1)  # [n * t]
        step = torch.arange(GROUP, device=z.device) * stride  # [G]
        where = (rows * t + cols)[:, None] + step  # [P, G] flat positions of the groups' logits
        values = flat[where]  # [P, G]
        keep = (values > bar[rows][:, None]).view(-1).nonzero().squeeze(1)  # >= 1 per group
        rows = rows.repeat_interleave(GROUP).index_select(0, keep)
        return rows, values.view(-1).index_select(0, keep), where.view(-1).index_select(0, keep)

    def _dense(self, z: torch.Tensor) -> Found:
        """The tile's own top ``min(k, t)`` of every row, as candidates."""
        n, t = z.shape
        top = z.topk(min(self.k, t), dim=1)  # [n, k']
        rows = torch.arange(n, device=z.device)[:, None].expand_as(top.indices)
        return rows.reshape(-1), top.values.reshape(-1), (top.indices + rows * t).reshape(-1)

    def add_(self, found: Found | None, e: torch.Tensor, v0: int, lse: OnlineLogSumExp) -> None:
        """Take the tile's candidates ``found`` (from ``candidates``) whose ``exp(z - m')`` is
        ``e`` ``[n, t]`` (contiguous, destroyed), after ``lse.add_`` folded the tile in."""
        self.tail.mul_(lse.scale)
        if found is not None:
            rows, values, where = found
            e.view(-1)[where] = 0.0  # the candidates' mass is counted when they leave
            self._pending.append((rows, values, where - rows * e.shape[1] + v0))
            self._count += values.numel()
        self.tail.add_(e.sum(dim=1))  # the rest of the tile
        if self._count >= self.values.numel():
            self.finish(lse)

    def finish(self, lse: OnlineLogSumExp) -> None:
        """Merge the pending candidates into ``values`` / ``ids``; the evicted go to ``tail``."""
        if not self._pending:
            return
        n, device = self.values.shape[0], self.values.device
        rows, values, ids = (torch.cat(part) for part in zip(*self._pending, strict=True))
        self._pending, self._count = [], 0
        order = torch.argsort(rows, stable=True)
        rows, values, ids = rows[order], values[order], ids[order]  # [Q] grouped by row
        counts = torch.bincount(rows, minlength=n)  # [n]
        slot = torch.arange(rows.numel(), device=device) - (counts.cumsum(0) - counts)[rows]
        width = int(counts.max())
        every = torch.full((n, self.k + width), float("-inf"), device=device)  # [n, k + w]
        every_ids = torch.zeros(n, self.k + width, dtype=torch.long, device=device)
        every[:, : self.k], every_ids[:, : self.k] = self.values, self.ids
        every[rows, slot + self.k], every_ids[rows, slot + self.k] = values, ids
        best = every.topk(self.k, dim=1)  # [n, k]
        evicted = torch.ones_like(every, dtype=torch.bool).scatter_(1, best.indices, False)
        self.tail.add_((every - lse.m[:, None]).exp_().mul_(evicted).sum(dim=1))
        self.values, self.ids = best.values, every_ids.gather(1, best.indices)


def tiled_token_outputs(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor,
    spec: TokenOutputs,
    *,
    gather_ids: torch.Tensor | None,
    out: dict[str, torch.Tensor],
    chunk_tokens: int = 1024,
    tile: int = DEFAULT_TILE,
    transform: LogitTransform | None = None,
) -> dict[str, torch.Tensor]:
    """``chunked_token_outputs`` for a spec without a sampler, with vocabulary tiles.

    ``hidden`` ``[N, H]``, ``labels`` ``[N]``, ``gather_ids`` ``[N, K]`` or ``[K]`` (int64,
    validated), ``out`` the result arrays to fill (``teacher._allocate``). Same outputs and
    layout; every reduction runs on ``[rows, tile]`` slices with the running logsumexp.
    """
    if spec.sampling is not None:
        raise ValueError("a sampler's support needs the whole vocabulary: use the blocks")
    transform = transform or LogitTransform()
    want = spec.outputs
    for lo in range(0, hidden.shape[0], max(1, chunk_tokens)):
        hi = min(lo + chunk_tokens, hidden.shape[0])
        n, device = hi - lo, hidden.device
        acc = OnlineLogSumExp(n, device, entropy="entropy" in want)
        top = OnlineTopK(n, spec.topk, device) if "topk" in want else None
        label = torch.zeros(n, dtype=torch.float32, device=device)  # [n]
        ids = picked = None
        if gather_ids is not None and gather_ids.numel():
            ids = gather_ids[lo:hi] if gather_ids.dim() == 2 else gather_ids.expand(n, -1)
            picked = torch.zeros(ids.shape, dtype=torch.float32, device=device)  # [n, K]
        for v0, z in head_tiles(hidden[lo:hi], head, tile, transform, spec.temperature):
            pick_(label, z, v0, labels[lo:hi])  # the raw logits, before add_ takes the exp
            if picked is not None:
                pick_(picked, z, v0, ids)  # type: ignore[arg-type]
            found = top.candidates(z) if top is not None else None
            e = acc.add_(z, top.row_max if top is not None else None)  # [n, t] exp(z - m')
            if top is not None:
                top.add_(found, e, v0, acc)
        if top is not None:
            top.finish(acc)
        lse = acc.lse()  # [n]
        if "logps" in want:
            out["logps"][lo:hi] = label - lse
        if "entropy" in want:
            out["entropy"][lo:hi] = acc.entropy()
        if top is not None:
            out["topk_ids"][lo:hi] = top.ids.to(torch.int32)
            out["topk_logps"][lo:hi] = top.values - lse[:, None]
            out["topk_tail_logp"][lo:hi] = top.tail.log() - acc.s.log()
        if picked is not None:
            out["gather_logps"][lo:hi] = picked - lse[:, None]
    return out
