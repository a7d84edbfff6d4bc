"""Running sums over base-2 vocabulary tiles: what both tile folds start from.

``RunningSums`` holds the per-row state a running logsumexp ends with (max, sum, and the entropy
sum); ``OnlineLogSumExp`` folds ``[rows, tile]`` slices of base-2 logits into it with torch ops.
The compiled fold (``tiles.NativeFold``) and the torch top-k (``topk.OnlineTopK``) both read this
state, so it lives apart from either (``tiles`` imports ``topk``, and both import this module).

Naive equivalent: ``torch.logsumexp(z, dim=-1)`` over the whole row, and
``-(p * log p).sum(-1)`` with ``p = softmax(z)`` for the entropy.
"""

from __future__ import annotations

import torch

__all__ = ["LN2", "LOG2E", "OnlineLogSumExp", "RunningSums"]

LOG2E = 1.4426950408889634
"""``log2(e)``: tiles hold logits in base 2 (``y = z * log2(e)``, so ``exp(z) = exp2(y)``)."""

LN2 = 0.6931471805599453
"""``ln(2)``: converts base-2 results back to nats."""

_FLOOR = torch.finfo(torch.float32).min
"""Stand-in for a running max of ``-inf`` (a row whose logits so far are all ``-inf``), so
``exp2(m - m')`` and ``y - m'`` never meet ``-inf - (-inf)``."""


class RunningSums:
    """What a running logsumexp over base-2 tiles ends with: ``m`` ``[n]``, the running max
    (``_FLOOR`` while a row has seen only ``-inf``), ``s`` ``[n]``, the sum of ``exp2(y - m)``,
    and with entropy ``t`` ``[n]``, the sum of ``exp2(y - m) * (y - m)``."""

    def __init__(self, n: int, device: torch.device, entropy: bool = False) -> None:
        self.m = torch.full((n,), _FLOOR, dtype=torch.float32, device=device)  # [n]
        self.s = torch.zeros(n, dtype=torch.float32, device=device)  # [n]
        self.t = torch.zeros(n, dtype=torch.float32, device=device) if entropy else None  # [n]

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
        super().__init__(n, device, entropy)
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
