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
blocks on accelerators, whose one large matmul is the fast path. Each slice is folded into the
running state by the compiled kernel of ``native.py`` (``NativeFold``: one read per row) where
it builds, else by torch ops (``OnlineLogSumExp``, ``topk.OnlineTopK``).

Naive equivalent: ``log_softmax(transform(head(hidden)).float() / T).gather(-1, labels)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from worker.executor.config import ExecutorConfig
from worker.executor.head import native
from worker.executor.head.logprobs import LogitTransform, chunked_rows
from worker.executor.head.sums import LN2, LOG2E, OnlineLogSumExp, RunningSums
from worker.executor.head.topk import OnlineTopK
from worker.scorer.teacher import TokenOutputs

__all__ = [
    "DEFAULT_TILE",
    "IdPicker",
    "NativeFold",
    "head_tiles",
    "lm_head_path",
    "tileable",
    "tiled_token_logps",
    "tiled_token_outputs",
]

DEFAULT_TILE = 1024
"""Vocabulary rows per tile on CPU: a ``[1024, 1024]`` float32 slice is 4 MiB, within a server
core's share of cache; 512 and 2,048 measured within noise of it on SmolLM2 and V = 128,256."""


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


def lm_head_path(model: Any, config: ExecutorConfig, device: torch.device) -> str:
    """How ``model``'s LM head runs for log-probs and teacher outputs without a sampler:
    ``native tiles`` (vocabulary tiles folded by the compiled kernel, built here on first use),
    ``torch tiles`` (tiles folded by torch ops: ``native_head=False``,
    ``SCORING_WORKER_NATIVE=0`` or no compiler), ``blocks`` (whole-vocabulary blocks: not CPU,
    ``head_vocab_tile=0``, or a head that cannot be tiled), ``none`` (no model). A job's LoRA
    delta on the head takes the blocks for that job."""
    if model is None:
        return "none"
    if not config.vocab_tile(device.type) or not tileable(model.get_output_embeddings()):
        return "blocks"
    if config.native_head and device.type == "cpu" and native.kernel() is not None:
        return "native tiles"
    return "torch tiles"


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
    (``log2(e) / T``) as it reads. The top k is a min-heap per row (``values`` unordered: sort
    them at the end, as ``tiled_token_outputs`` does); ``tail`` sums ``exp2(y - m)`` of every
    other token seen, as in ``OnlineTopK``.
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
        super().__init__(n, device, entropy)
        self.kernel, self.factor = kernel, factor
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
