"""The vocabulary-parallel LM head: each rank folds its own vocabulary shard into per-row
statistics, and the ranks combine those statistics, never the logits.

Rank ``r`` of ``W`` holds the head's rows ``v0 .. v0 + Vl - 1`` (``Vl = V / W``). For the
scored rows ``[N, H]`` it computes its logits one ``[c, Vl]`` float32 block at a time
(``fold_shard``; the model's logit transform, then ``/ T``, as in one process) and keeps, per
row, in one float32 ``[N, C]`` matrix:

==============  ======================================================================
column(s)       per row, over this rank's shard only
==============  ======================================================================
``m``           the max logit ``z``
``s``           ``sum exp(z - m)``
``label``       the label's logit when this shard holds the label, else 0
``t``           ``sum exp(z - m) * (z - m)`` (entropy)
top ``k``       the shard's ``k`` largest logits and their global ids (``-inf`` pads when the
                shard has fewer than ``k`` ids), and ``tail``: ``sum exp(z - m)`` of the
                shard's other ids, summed directly
gather ``K``    the logits at the gathered ids this shard holds, else 0
==============  ======================================================================

The ranks all-gather these ``[W, N, C]`` (``collectives.Comm.combine_rows``) and every rank
finishes alike (``combine``), with ``M = max_r m_r`` and ``w_r = exp(m_r - M)``::

    S = sum_r w_r s_r                 logZ = M + log S        logp = sum_r label_r - logZ
    entropy = log S - sum_r w_r (t_r + (m_r - M) s_r) / S
    top k   = the k best of the W * k candidates; tail = sum_r w_r tail_r + the mass of the
              candidates that lost (no 1 - sum(top) cancellation)
    gather  = sum_r gathered_r - logZ

so only ``O(N (k + K))`` numbers cross the wire and no rank holds more than one
``[c, V / W]`` block. Naive equivalent: ``log_softmax(transform(head(hidden)).float() / T)``
over the whole vocabulary, read as in ``worker.executor.head.teacher``; the tests build the
shards of one head in one process and assert the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.errors import ConfigError
from worker.executor.head.logprobs import LogitTransform
from worker.scorer.teacher import TokenOutputs

__all__ = ["Columns", "VocabShard", "combine", "fold_shard", "vocab_shard"]

_FLOOR = torch.finfo(torch.float32).min
"""Stand-in for the max of a row whose shard logits are all ``-inf``."""


@dataclass(frozen=True)
class VocabShard:
    """One rank's rows of the LM head: ``weight`` ``[Vl, H]`` (and ``bias`` ``[Vl]``) for the
    vocabulary ids ``v0 .. v0 + Vl - 1`` of ``vocab``."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    v0: int
    vocab: int

    @property
    def width(self) -> int:
        """``Vl``, the ids this shard holds."""
        return int(self.weight.shape[0])

    def logits(
        self, hidden: torch.Tensor, transform: LogitTransform, temperature: float
    ) -> torch.Tensor:
        """``transform(hidden @ weight.T + bias) / T`` as float32 ``[c, Vl]`` (one block)."""
        z = torch.mm(hidden, self.weight.t())  # [c, Vl] head dtype
        if self.bias is not None:
            z += self.bias
        z = z.float()  # no-op for a float32 head; one [c, Vl] copy for a half-precision one
        transform.apply_(z)
        if temperature != 1.0:
            z.div_(temperature)
        return z


def vocab_shard(head: nn.Module, rank: int, size: int) -> VocabShard:
    """This rank's ``VocabShard`` of ``head``: the local part of a weight that transformers
    split on the vocabulary (a ``DTensor`` placed ``Shard(0)``), or rows ``rank * V / size ..``
    of a whole ``nn.Linear`` weight (tests build every shard of one head that way)."""
    weight: Any = getattr(head, "weight", None)
    bias: Any = getattr(head, "bias", None)
    if not isinstance(head, nn.Linear) or weight is None:
        raise ConfigError(f"the LM head ({type(head).__name__}) is not a linear layer")
    vocab = int(head.out_features)
    if vocab % size:
        raise ConfigError(f"the vocabulary of {vocab} does not split over {size} ranks")
    width = vocab // size
    placements = getattr(weight, "placements", None)
    if placements is not None:  # a DTensor: transformers sharded it
        if [type(p).__name__ for p in placements] != ["Shard"] or placements[0].dim != 0:
            raise ConfigError(
                f"the LM head's weight is placed {placements}, not split on the vocabulary"
            )
        local = weight.to_local().detach()
        if bias is not None and getattr(bias, "placements", None) is not None:
            bias = bias.to_local()
    else:
        local = weight.detach()[rank * width : (rank + 1) * width]
        if bias is not None:
            bias = bias.detach()[rank * width : (rank + 1) * width]
    if int(local.shape[0]) != width:
        raise ConfigError(f"rank {rank} holds {local.shape[0]} LM-head rows, expected {width}")
    return VocabShard(local, None if bias is None else bias.detach(), rank * width, vocab)


@dataclass(frozen=True)
class Columns:
    """Where each statistic sits in a row of ``fold_shard``'s ``[N, C]`` matrix."""

    entropy: bool = False
    topk: int = 0
    gathered: int = 0

    @classmethod
    def of(cls, spec: TokenOutputs) -> Columns:
        """The columns a call's request needs (log-probs alone: ``m``, ``s``, ``label``)."""
        return cls(
            "entropy" in spec.outputs,
            spec.topk if "topk" in spec.outputs else 0,
            spec.gather_k if "gather" in spec.outputs else 0,
        )

    @property
    def top(self) -> int:
        """First top-k column (values, then ids, then the tail)."""
        return 3 + int(self.entropy)

    @property
    def gather(self) -> int:
        """First gather column."""
        return self.top + (2 * self.topk + 1 if self.topk else 0)

    @property
    def width(self) -> int:
        """C, the columns of a row."""
        return self.gather + self.gathered


def _pick(z: torch.Tensor, ids: torch.Tensor, shard: VocabShard, *, shared: bool) -> torch.Tensor:
    """``z`` ``[c, Vl]`` at the global ``ids`` this shard holds, 0 elsewhere: one id per row
    (``[c]`` labels, or ``[c, K]``), or ``shared`` ids ``[K]`` read in every row (``[c, K]``)."""
    local = ids - shard.v0
    own = (local >= 0) & (local < shard.width)
    index = local.clamp(0, shard.width - 1)
    if shared:
        return z.index_select(1, index).where(own, 0.0)  # [c, K]
    if ids.dim() == 2:
        return z.gather(1, index).where(own, 0.0)  # [c, K]
    return z.gather(1, index[:, None]).squeeze(1).where(own, 0.0)  # [c]


def fold_shard(
    hidden: torch.Tensor,
    shard: VocabShard,
    labels: torch.Tensor,
    cols: Columns,
    *,
    temperature: float,
    transform: LogitTransform,
    gather_ids: torch.Tensor | None,
    chunk_rows: int,
) -> torch.Tensor:
    """This shard's statistics (module table) of ``hidden`` ``[N, H]`` predicting ``labels``
    ``[N]``, ``chunk_rows`` rows at a time: float32 ``[N, cols.width]``. ``gather_ids``:
    ``[N, K]`` per-position or ``[K]`` shared global ids (validated), when ``cols.gathered``."""
    n = hidden.shape[0]
    out = torch.empty(n, cols.width, dtype=torch.float32, device=hidden.device)  # [N, C]
    k = min(cols.topk, shard.width)
    for lo in range(0, n, max(1, chunk_rows)):
        hi = min(n, lo + chunk_rows)
        row = out[lo:hi]  # [c, C]
        z = shard.logits(hidden[lo:hi], transform, temperature)  # [c, Vl] the one block
        row[:, 2] = _pick(z, labels[lo:hi], shard, shared=False)
        if cols.gathered:
            assert gather_ids is not None
            shared = gather_ids.dim() == 1
            ids = gather_ids if shared else gather_ids[lo:hi]
            row[:, cols.gather :] = _pick(z, ids, shard, shared=shared)  # [c, K]
        top = z.topk(k, dim=1) if cols.topk else None  # [c, k] (unordered is fine)
        m = z.amax(dim=1).clamp_(min=_FLOOR)  # [c]
        e = z.sub_(m[:, None]).exp_()  # [c, Vl] exp(z - m), in place: still one block
        row[:, 0], row[:, 1] = m, e.sum(dim=1)
        kept = None
        if top is not None:
            a, t = cols.top, cols.topk
            row[:, a : a + t] = float("-inf")  # a shard with fewer than k ids pads
            row[:, a + t : a + 2 * t] = 0.0
            row[:, a : a + k] = top.values
            row[:, a + t : a + t + k] = (top.indices + shard.v0).float()  # exact below 2^24
            kept = e.gather(1, top.indices)  # [c, k]
            row[:, a + 2 * t] = e.scatter_(1, top.indices, 0.0).sum(dim=1)  # the tail, direct
        if cols.entropy:  # sum e (z - m) as sum xlogy(e, e): an exp that underflowed adds 0
            dot = torch.special.xlogy(e, e, out=e).sum(dim=1)  # [c]
            if kept is not None:
                dot += torch.special.xlogy(kept, kept).sum(dim=1)
            row[:, 3] = dot
    return out


def combine(gathered: torch.Tensor, cols: Columns, spec: TokenOutputs) -> dict[str, torch.Tensor]:
    """Every rank's statistics ``[W, N, C]`` (``fold_shard``'s, stacked in rank order) into the
    arrays ``spec`` asks for, float32 (int32 ``topk_ids``), keyed as ``head.teacher``'s."""
    m, s = gathered[:, :, 0], gathered[:, :, 1]  # [W, N]
    top_m = m.amax(dim=0)  # [N]
    w = torch.exp(m - top_m)  # [W, N]
    total = (w * s).sum(dim=0)  # [N] S
    log_total = total.log()
    lse = top_m + log_total  # [N] logZ
    want = spec.outputs
    out: dict[str, torch.Tensor] = {}
    if "logps" in want:
        out["logps"] = gathered[:, :, 2].sum(dim=0) - lse  # [N]
    if cols.entropy:
        dot = (w * (gathered[:, :, 3] + (m - top_m) * s)).sum(dim=0)  # [N]
        out["entropy"] = log_total - dot / total
    if cols.topk:
        a, k = cols.top, cols.topk
        n = gathered.shape[1]
        values = gathered[:, :, a : a + k].permute(1, 0, 2).reshape(n, -1)  # [N, W * k]
        ids = gathered[:, :, a + k : a + 2 * k].permute(1, 0, 2).reshape(n, -1)
        best = values.topk(k, dim=1)  # [N, k] descending
        lost = torch.ones_like(values, dtype=torch.bool).scatter_(1, best.indices, False)
        lost_mass = ((values - top_m[:, None]).exp() * lost).sum(dim=1)  # [N]; -inf pads: 0
        tail = (w * gathered[:, :, a + 2 * k]).sum(dim=0) + lost_mass  # [N]
        out["topk_ids"] = ids.gather(1, best.indices).to(torch.int32)  # [N, k]
        out["topk_logps"] = best.values - lse[:, None]  # [N, k]
        out["topk_tail_logp"] = tail.log() - log_total  # [N] -inf when the top k hold it all
    if cols.gathered:
        out["gather_logps"] = gathered[:, :, cols.gather :].sum(dim=0) - lse[:, None]  # [N, K]
    return out
