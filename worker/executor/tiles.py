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
from dataclasses import dataclass

import torch
from torch import nn

from worker.executor import native
from worker.executor.logprobs import LogitTransform, chunked_rows
from worker.scorer.teacher import TokenOutputs

__all__ = [
    "DEFAULT_TILE",
    "Found",
    "IdPicker",
    "NativeFold",
    "OnlineLogSumExp",
    "OnlineTopK",
    "RunningSums",
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

LOG2E = 1.4426950408889634
"""``log2(e)``: tiles hold logits in base 2 (``y = z * log2(e)``, so ``exp(z) = exp2(y)``)."""

LN2 = 0.6931471805599453
"""``ln(2)``: converts base-2 results back to nats."""

_FLOOR = torch.finfo(torch.float32).min
"""Stand-in for a running max of ``-inf`` (a row whose logits so far are all ``-inf``), so
``exp2(m - m')`` and ``y - m'`` never meet ``-inf - (-inf)``."""


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
    scale: bool = True,
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(v0, y)`` for each tile: ``y`` ``[n, t]`` float32 holds ``transform(logits) / T`` of
    vocabulary ids ``v0 .. v0 + t - 1`` in base 2 (times ``log2(e)``: ``exp2(y)`` is the
    natural ``exp``, whose CPU kernel costs ~3x ``exp2``'s). ``y`` is free to change in place
    until the next tile: it is one buffer, overwritten by each tile's matmul. With ``scale``
    False, ``y`` is ``transform(logits)`` alone (the native kernel multiplies as it reads).

    The factor multiplies each tile after the transform (one pass over a tile in cache). Folding
    it into the ``[n, H]`` rows before the matmul would save that pass but measured a larger
    error on SmolLM2 (max |logp error| 2.5e-5 against float64, where plain float32
    ``log_softmax`` has 1.8e-5, as this order has)."""
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    # scoring needs no gradients, and the matmuls write into one buffer (out=)
    weight, bias = head.weight.detach(), None if head.bias is None else head.bias.detach()
    hidden = hidden.detach()  # weight [V, H], bias [V] | None, hidden [n, H]
    vocab, n = weight.shape[0], hidden.shape[0]
    factor = LOG2E / temperature
    # One output buffer for every tile: a fresh [n, t] allocation per tile may be new pages
    # (a page fault per 4 KiB) each time the allocator hands memory back between tiles.
    buf = torch.empty(n * min(tile, vocab), dtype=hidden.dtype, device=hidden.device)
    for v0 in range(0, vocab, tile):
        v1 = min(vocab, v0 + tile)
        z = buf[: n * (v1 - v0)].view(n, v1 - v0)  # [n, t]
        if bias is None:
            torch.mm(hidden, weight[v0:v1].t(), out=z)
        else:
            torch.addmm(bias[v0:v1], hidden, weight[v0:v1].t(), out=z)
        z = z.float()  # no-op for a float32 head; a [n, t] copy for a half-precision one
        transform.apply_(z)
        if scale:
            z.mul_(factor)
        yield v0, z


class RunningSums:
    """What a running logsumexp over base-2 tiles ends with: ``m`` ``[n]``, the running max
    (``_FLOOR`` while a row has seen only ``-inf``), ``s`` ``[n]``, the sum of ``exp2(y - m)``,
    and with entropy ``t`` ``[n]``, the sum of ``exp2(y - m) * (y - m)``."""

    m: torch.Tensor
    s: torch.Tensor
    t: torch.Tensor | None

    def lse2(self) -> torch.Tensor:
        """``log2 sum exp2(y)`` of everything folded in, ``[n]`` (``-inf`` for an all ``-inf``
        row): base-2 log-probs are ``y - lse2()``."""
        return self.m + self.s.log2()

    def lse(self) -> torch.Tensor:
        """``logsumexp`` of the natural logits, ``[n]``."""
        return self.lse2() * LN2

    def entropy(self) -> torch.Tensor:
        """``-sum p ln p`` per row in nats, ``[n]`` (needs the entropy sum)."""
        assert self.t is not None, "the entropy sum was not kept (entropy=True)"
        return (self.s.log2() - self.t / self.s) * LN2


class OnlineLogSumExp(RunningSums):
    """Running ``logsumexp`` over vocabulary tiles of base-2 logits ``y`` (``head_tiles``),
    one value per row (float32 ``[n]``).

    ``m`` is the running max (``_FLOOR`` while a row has seen only ``-inf``), ``s`` the sum of
    ``exp2(y - m)`` so far. With ``entropy``, ``t`` also keeps ``sum(exp2(y - m) * (y - m))``,
    so that at the end ``entropy = ln 2 * (log2 s - t / s)`` (``-sum p ln p``).
    """

    def __init__(self, n: int, device: torch.device, entropy: bool = False) -> None:
        self.m = torch.full((n,), _FLOOR, dtype=torch.float32, device=device)  # [n]
        self.s = torch.zeros(n, dtype=torch.float32, device=device)  # [n]
        self.t = torch.zeros(n, dtype=torch.float32, device=device) if entropy else None  # [n]
        self.scale = torch.ones(n, dtype=torch.float32, device=device)  # [n] the last rescale
        self._e: torch.Tensor | None = None  # [n * tile] exp buffer (entropy keeps y beside it)

    def add_(self, y: torch.Tensor, row_max: torch.Tensor | None = None) -> torch.Tensor:
        """Fold ``y`` ``[n, t]`` in (overwritten; ``row_max``, its max per row when known);
        returns ``exp2(y - m')`` ``[n, t]`` (contiguous): ``y`` itself, or with ``entropy`` a
        buffer reused by the next call."""
        if row_max is None:
            row_max = y.amax(dim=1)  # [n]
        new_m = torch.maximum(self.m, row_max)  # [n] finite: _FLOOR bounds it below
        scale = torch.exp2(self.m - new_m)  # [n] rescales what was summed against the old max
        y.sub_(new_m[:, None])  # [n, t] y - m'; -inf stays -inf
        if self.t is not None:
            # t' = scale * (t + (m - m') * s) + sum(e * (y - m'))
            self.t.addcmul_(self.m - new_m, self.s).mul_(scale)
            if self._e is None or self._e.numel() < y.numel():
                self._e = torch.empty(y.numel(), dtype=y.dtype, device=y.device)
            e = torch.exp2(y, out=self._e[: y.numel()].view(y.shape))  # [n, t] beside y - m'
            dot = y.mul_(e).sum(dim=1)  # [n] sum(e * (y - m')); y is spent
            if bool(dot.isnan().any()):  # a -inf logit: 0 * -inf, which adds 0
                dot = y.nan_to_num_(nan=0.0).sum(dim=1)
            self.t += dot
        else:
            e = y.exp2_()  # [n, t]
        self.s.mul_(scale).add_(e.sum(dim=1))
        self.m, self.scale = new_m, scale
        return e


class IdPicker:
    """The logits at given vocabulary ids, each read from the tile that holds it: ``ids``
    ``[n]`` (a label per row) or ``[n, K]`` (K ids per row) are sorted once, so each tile reads
    its few entries with one index. ``picked`` has the shape of ``ids``; an id outside
    ``0..V-1`` is never read and leaves 0."""

    def __init__(self, ids: torch.Tensor, vocab: int, tile: int) -> None:
        self.picked = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
        width = ids.shape[1] if ids.dim() == 2 else 1
        self._ids, self._where = ids.reshape(-1).sort()  # [n * K]: ids, their flat positions
        self._rows = self._where // width  # [n * K]
        starts = torch.arange(0, vocab + tile, tile, device=ids.device).clamp_(max=vocab)
        self._bounds = torch.searchsorted(self._ids, starts).tolist()  # per tile, then V
        self._tile = tile

    def pick_(self, y: torch.Tensor, v0: int) -> None:
        """Copy this tile's (``v0 ..``) entries from ``y`` ``[n, t]``."""
        i = v0 // self._tile
        lo, hi = self._bounds[i], self._bounds[i + 1]
        if hi > lo:
            got = y[self._rows[lo:hi], self._ids[lo:hi] - v0]  # [r]
            self.picked.view(-1)[self._where[lo:hi]] = got


class NativeFold(RunningSums):
    """The running state of ``OnlineLogSumExp`` (``m``, ``s``, with ``entropy`` ``t``) and,
    with ``k``, of ``OnlineTopK`` (``values``, ``ids``, ``tail``), folded by the compiled
    kernel (``native.py``) one tile at a time. ``fold_`` takes a tile of ``transform(logits)``
    not yet scaled (``head_tiles(..., scale=False)``): the kernel multiplies by ``factor``
    (``log2(e) / T``) as it reads. The top k is a min-heap per row, unordered until
    ``finish``; ``tail`` sums ``exp2(y - m)`` of every other token seen, as in ``OnlineTopK``.
    """

    def __init__(
        self,
        kernel: native.NativeTiles,
        n: int,
        device: torch.device,
        factor: float,
        entropy: bool = False,
        k: int = 0,
    ) -> None:
        self.kernel, self.factor = kernel, factor
        self.m = torch.full((n,), _FLOOR, dtype=torch.float32, device=device)  # [n]
        self.s = torch.zeros(n, dtype=torch.float32, device=device)  # [n]
        self.t = torch.zeros(n, dtype=torch.float32, device=device) if entropy else None
        self.heap: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if k:
            self.values = torch.full((n, k), float("-inf"), dtype=torch.float32, device=device)
            self.ids = torch.zeros(n, k, dtype=torch.long, device=device)  # [n, k]
            self.tail = torch.zeros(n, dtype=torch.float32, device=device)  # [n]
            self.heap = (self.values, self.ids, self.tail)

    def fold_(self, y: torch.Tensor, v0: int) -> None:
        """Fold the tile ``y`` ``[n, t]`` (ids ``v0 ..``; left unchanged) into the state."""
        self.kernel.reduce(y, v0, self.factor, self.m, self.s, self.t, self.heap)

    def finish(self) -> None:
        """Order the top ``k`` (descending)."""
        self.values, order = self.values.sort(dim=1, descending=True)
        self.ids = self.ids.gather(1, order)


def _native_kernel(native_ok: bool, hidden: torch.Tensor) -> native.NativeTiles | None:
    """The compiled kernel when it may fold these tiles: allowed, on CPU, and built here."""
    if not native_ok or hidden.device.type != "cpu":
        return None
    return native.kernel()


def tiled_token_logps(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    tile: int = DEFAULT_TILE,
    transform: LogitTransform | None = None,
    native_ok: bool = True,
) -> torch.Tensor:
    """``chunked_token_logps`` with vocabulary tiles: ``[N, H]`` hidden, ``[N]`` labels ->
    ``[N]`` float32 log-probs, ``chunk_tokens`` rows x ``tile`` vocabulary ids at a time;
    each tile folded by the compiled kernel (``native.py``) when ``native_ok`` and it is
    available on this CPU, else by torch ops.

    Naive equivalent: ``naive_token_logps(transform(head(hidden)), labels, temperature)``.
    """
    kernel = _native_kernel(native_ok, hidden)

    def block(rows: torch.Tensor, lab: torch.Tensor, transform: LogitTransform) -> torch.Tensor:
        label = IdPicker(lab, head.weight.shape[0], tile)
        if kernel is not None:
            fold = NativeFold(kernel, rows.shape[0], rows.device, LOG2E / temperature)
            for v0, z in head_tiles(rows, head, tile, transform, temperature, scale=False):
                label.pick_(z, v0)
                fold.fold_(z, v0)
            return (label.picked * fold.factor - fold.lse2()) * LN2
        acc = OnlineLogSumExp(rows.shape[0], rows.device)
        for v0, y in head_tiles(rows, head, tile, transform, temperature):
            label.pick_(y, v0)  # before add_ overwrites y
            acc.add_(y)
        return (label.picked - acc.lse2()) * LN2

    return chunked_rows(
        hidden,
        labels,
        block,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
        transform=transform,
    )


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
    native_ok: bool = True,
) -> dict[str, torch.Tensor]:
    """``chunked_token_outputs`` for a spec without a sampler, with vocabulary tiles.

    ``hidden`` ``[N, H]``, ``labels`` ``[N]``, ``gather_ids`` ``[N, K]`` or ``[K]`` (int64,
    validated), ``out`` the result arrays to fill (``teacher._allocate``). Same outputs and
    layout; every reduction runs on ``[rows, tile]`` slices with the running logsumexp, folded
    by the compiled kernel (``native.py``) when ``native_ok`` and it is available, else by
    torch ops (``OnlineLogSumExp``, ``OnlineTopK``).
    """
    if spec.sampling is not None:
        raise ValueError("a sampler's support needs the whole vocabulary: use the blocks")
    transform = transform or LogitTransform()
    kernel = _native_kernel(native_ok, hidden)
    want, vocab = spec.outputs, head.weight.shape[0]
    for lo in range(0, hidden.shape[0], max(1, chunk_tokens)):
        hi = min(lo + chunk_tokens, hidden.shape[0])
        n, device = hi - lo, hidden.device
        label = IdPicker(labels[lo:hi], vocab, tile)
        picked = None
        if gather_ids is not None and gather_ids.numel():
            ids = gather_ids[lo:hi] if gather_ids.dim() == 2 else gather_ids.expand(n, -1)
            picked = IdPicker(ids, vocab, tile)  # [n, K]
        tiles = head_tiles(
            hidden[lo:hi], head, tile, transform, spec.temperature, scale=kernel is None
        )
        factor = 1.0  # what the picked logits still need to be base 2
        sums: RunningSums
        if kernel is not None:
            k = spec.topk if "topk" in want else 0
            fold = NativeFold(kernel, n, device, LOG2E / spec.temperature, "entropy" in want, k)
            for v0, z in tiles:
                label.pick_(z, v0)
                if picked is not None:
                    picked.pick_(z, v0)
                fold.fold_(z, v0)
            sums, factor = fold, fold.factor
            if k:
                values, order = fold.values.sort(dim=1, descending=True)
                top = (values, fold.ids.gather(1, order), fold.tail)
        else:
            acc = OnlineLogSumExp(n, device, entropy="entropy" in want)
            online = OnlineTopK(n, spec.topk, device) if "topk" in want else None
            for v0, y in tiles:
                label.pick_(y, v0)  # the raw logits, before add_ takes the exp
                if picked is not None:
                    picked.pick_(y, v0)
                found = online.candidates(y) if online is not None else None
                e = acc.add_(y, online.row_max if online is not None else None)  # exp2(y - m')
                if online is not None:
                    online.add_(found, e, v0, acc)
            sums = acc
            if online is not None:
                online.finish(acc)
                top = (online.values, online.ids, online.tail)
        lse2 = sums.lse2()  # [n] base 2
        if "logps" in want:
            out["logps"][lo:hi] = (label.picked * factor - lse2) * LN2
        if "entropy" in want:
            out["entropy"][lo:hi] = sums.entropy()
        if "topk" in want:
            values, top_ids, tail = top
            out["topk_ids"][lo:hi] = top_ids.to(torch.int32)
            out["topk_logps"][lo:hi] = (values - lse2[:, None]) * LN2
            out["topk_tail_logp"][lo:hi] = tail.log() - sums.s.log()
        if picked is not None:
            out["gather_logps"][lo:hi] = (picked.picked * factor - lse2[:, None]) * LN2
    return out
