"""Running top-k over vocabulary tiles with torch ops (the tiles' fallback when the compiled
kernel of ``native.py`` is not there): ``OnlineTopK`` keeps the best ``k`` base-2 logits of each
row and the mass outside them while ``tiles.tiled_token_outputs`` walks the vocabulary.

Naive equivalent: ``log_softmax(logits / T).topk(k)`` and ``log(1 - sum(exp(top)))`` over the
whole vocabulary at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.executor.head.sums import OnlineLogSumExp

__all__ = ["GROUP", "Found", "OnlineTopK"]

GROUP = 16
"""Vocabulary ids per group in ``OnlineTopK.candidates``' pre-filter."""


@dataclass
class Found:
    """A tile's top-k candidates: ``dense``, the tile's own top ``k`` per row (values and
    positions in the tile, ``[n, k']`` each), or, from the grouped filter, flat ``rows``
    ``[P]``, ``values`` ``[P]`` and ``where`` ``[P]`` (positions in the tile's flat
    ``[n * t]`` view)."""

    dense: tuple[torch.Tensor, torch.Tensor] | None = None
    rows: torch.Tensor | None = None
    values: torch.Tensor | None = None
    where: torch.Tensor | None = None


class OnlineTopK:
    """Running top ``k`` logits over vocabulary tiles, and the mass outside them.

    Once ``finish`` ran, ``values`` ``[n, k]`` (descending, base-2 logits as in ``head_tiles``)
    and ``ids`` ``[n, k]`` are the best ``k`` seen; ``tail`` ``[n]`` sums ``exp2(y - m)``
    (``m``, the ``OnlineLogSumExp`` max) over every other token seen, directly (the tiles'
    remainders and the candidates a merge evicts), with no ``1 - sum(top)`` cancellation.
    Between merges ``values`` are unordered and ``bar`` ``[n]`` is their minimum, the k-th best.

    ``torch.topk`` over a short row costs ~50x a max, so a tile is not searched with it once
    every row holds ``k`` values: the tile is cut into ``GROUP`` strided groups (ids ``j,
    j + t/G, j + 2t/G, ...``: their max is a vectorised reduction over the tile's rows), only
    the groups whose max beats its row's bar are read, and their logits above the bar are the
    candidates. They wait in a flat list and are merged (one unsorted top-k over each row's kept
    ``k`` and its candidates) once they number ``n * k``: after the first tiles the bar is high,
    a tile brings about ``k / tiles seen`` candidates a row, and most tiles cost a few maxima.
    """

    def __init__(self, n: int, k: int, device: torch.device) -> None:
        self.k = k
        self.values = torch.full((n, k), float("-inf"), dtype=torch.float32, device=device)
        self.ids = torch.zeros(n, k, dtype=torch.long, device=device)  # [n, k]
        self.bar = torch.full((n,), float("-inf"), dtype=torch.float32, device=device)  # [n]
        self.tail = torch.zeros(n, dtype=torch.float32, device=device)  # [n]
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._count = 0
        self._full = False  # every row's bar is finite (checked at each merge, not each tile)
        self._steps: dict[int, torch.Tensor] = {}  # stride -> [G] offsets of a group's ids
        self.row_max: torch.Tensor | None = None  # [n] the last tile's max, when it was read

    def candidates(self, y: torch.Tensor) -> Found | None:
        """This tile's candidates in the logits ``y`` ``[n, t]`` (before exp, contiguous): a
        superset of the tile's logits that beat the bar, or None when no row has one."""
        n, t = y.shape
        self.row_max = None
        if t % GROUP or not self._full:  # ragged, or a row not yet full
            return self._dense(y)
        stride = t // GROUP
        gmax = y.view(n, GROUP, stride).amax(dim=1)  # [n, t/G] group j: [:, :, j]
        self.row_max = gmax.amax(dim=1)  # [n] the tile's, for OnlineLogSumExp.add_
        hit = gmax > self.bar[:, None]  # [n, t/G]
        rows, cols = hit.nonzero(as_tuple=True)  # [P]
        if not rows.numel():
            return None
        if rows.numel() * GROUP > 4 * n * min(self.k, t):  # early tiles: most groups
            return self._dense(y)  # topk is cheaper, and holds [n, k] instead of [P, G]
        flat = y.view(-1)  # [n * t]
        step = self._steps.get(stride)
        if step is None:
            step = self._steps[stride] = torch.arange(GROUP, device=y.device) * stride  # [G]
        where = (rows * t + cols)[:, None] + step  # [P, G] flat positions of the groups' logits
        values = flat[where]  # [P, G]
        keep = (values > self.bar[rows][:, None]).view(-1).nonzero().squeeze(1)  # >= 1 a group
        return Found(
            rows=rows.repeat_interleave(GROUP).index_select(0, keep),
            values=values.view(-1).index_select(0, keep),
            where=where.view(-1).index_select(0, keep),
        )

    def _dense(self, y: torch.Tensor) -> Found:
        """The tile's own top ``min(k, t)`` of every row, as candidates."""
        top = y.topk(min(self.k, y.shape[1]), dim=1, sorted=False)  # [n, k']
        return Found(dense=(top.values, top.indices))

    def add_(self, found: Found | None, e: torch.Tensor, v0: int, lse: OnlineLogSumExp) -> None:
        """Take the tile's candidates ``found`` (from ``candidates``) whose ``exp2(y - m')`` is
        ``e`` ``[n, t]`` (contiguous, destroyed), after ``lse.add_`` folded the tile in."""
        self.tail.mul_(lse.scale)
        if found is not None and found.dense is not None:
            values, where = found.dense  # [n, k']
            e.scatter_(1, where, 0.0)  # the candidates' mass is counted when they leave
            self.tail.add_(e.sum(dim=1))  # the rest of the tile
            self._merge(values, where + v0, lse)
            return
        if found is not None:
            assert found.rows is not None and found.values is not None and found.where is not None
            e.view(-1)[found.where] = 0.0
            ids = found.where - found.rows * e.shape[1] + v0
            self._pending.append((found.rows, found.values, ids))
            self._count += found.values.numel()
        self.tail.add_(e.sum(dim=1))  # the rest of the tile
        if self._count >= self.values.numel():
            self._merge_pending(lse)

    def finish(self, lse: OnlineLogSumExp) -> None:
        """Merge what is pending and order ``values`` / ``ids`` (descending)."""
        self._merge_pending(lse)
        self.values, order = self.values.sort(dim=1, descending=True)
        self.ids = self.ids.gather(1, order)

    def _merge_pending(self, lse: OnlineLogSumExp) -> None:
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
        wide = torch.full((n, width), float("-inf"), device=device)  # [n, w]
        wide_ids = torch.zeros(n, width, dtype=torch.long, device=device)
        wide[rows, slot], wide_ids[rows, slot] = values, ids
        self._merge(wide, wide_ids, lse)

    def _merge(self, values: torch.Tensor, ids: torch.Tensor, lse: OnlineLogSumExp) -> None:
        """Keep the best ``k`` of ``values`` / ``ids`` and the new ``[n, w]`` ones (``-inf``
        pads); the evicted add ``exp2(value - m)`` to ``tail``."""
        every = torch.cat((self.values, values), dim=1)  # [n, k + w]
        every_ids = torch.cat((self.ids, ids), dim=1)
        best = every.topk(self.k, dim=1, sorted=False)  # [n, k]
        evicted = torch.ones_like(every, dtype=torch.bool).scatter_(1, best.indices, False)
        self.tail.add_((every - lse.m[:, None]).exp2_().mul_(evicted).sum(dim=1))
        self.values, self.ids = best.values, every_ids.gather(1, best.indices)
        self.bar = self.values.amin(dim=1)
        self._full = not bool(torch.isneginf(self.bar).any())
