"""The support a top-k / top-p / min-p sampler keeps, reduced one ``[c, V]`` logits block at a time.

``processed_logps`` in ``worker.executor.head.teacher`` is the sampled token's log-prob renormalised
over this support (vLLM's ``processed_logprobs``). Filters run in HF ``generate`` order, each on
the distribution the previous one left (all at the job's temperature):

1. top-k (``top_k`` > 0 and < V): keep tokens whose logit is >= the k-th largest logit.
2. top-p (``top_p`` < 1): sort the kept probabilities descending and keep the smallest prefix whose
   cumulative probability is >= ``top_p`` (token ``i`` kept iff the mass before it is < ``top_p``;
   the first token is always kept).
3. min-p (``min_p`` > 0): keep tokens with ``p >= min_p * p_max``.

Tie rule: every filter is a value threshold, so tokens tied with the last kept token are all kept
(top-k may keep more than k tokens; top-p more than the prefix). HF and vLLM keep top-k ties too;
their top-p breaks ties at the boundary by sort position, which is the only place we differ.

Both block functions take ``z = logits - rowmax`` (float32, ``[c, V]``) and return the support's
threshold on ``z`` and its unnormalised mass ``sum(exp(z) over z >= thr)``. Naive equivalent::

    keep = the three filters above on softmax(logits), as boolean [c, V]
    log_softmax(logits.masked_fill(~keep, -inf)).gather(-1, labels[:, None])
"""

from __future__ import annotations

import math

import torch

from worker.scorer.teacher import SORT_FREE_TOP_K, Sampling

__all__ = ["SORT_FREE_TOP_K", "Sampling", "masked_support", "processed_logps", "sorted_support"]


def masked_support(
    z: torch.Tensor, e: torch.Tensor, sampling: Sampling
) -> tuple[torch.Tensor, torch.Tensor]:
    """Threshold and mass of the top-k + min-p support without a sort; overwrites ``e``.

    ``z`` ``[c, V]`` is ``logits - rowmax``, ``e`` ``[c, V]`` is ``exp(z)`` (zeroed outside the
    support on return). Needs ``not sampling.needs_sort(V)``. Returns ``thr`` ``[c]``, ``mass``
    ``[c]``. Naive equivalent: ``keep = (p >= kth_largest(p)) & (p >= min_p * p.max())``,
    ``thr = z[keep].min()``, ``mass = exp(z)[keep].sum()``.
    """
    thr = torch.full(z.shape[:1], -math.inf, dtype=z.dtype, device=z.device)  # [c]
    k = sampling.top_k_for(z.shape[1])
    if k:
        thr = z.topk(k, dim=1).values[:, -1]  # [c] k-th largest, ties kept
    if sampling.min_p > 0.0:
        # p / p_max = exp(z - 0): the row max of z is exactly 0.
        thr = thr.clamp(min=math.log(sampling.min_p))  # [c]
    mass = e.masked_fill_(z < thr[:, None], 0.0).sum(dim=1)  # [c]
    return thr, mass


def sorted_support(z: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Threshold and mass of the top-k + top-p + min-p support from one sort of ``z``.

    ``z`` ``[c, V]`` is ``logits - rowmax``. Besides ``z`` it holds at most 3 ``[c, V]`` float32
    blocks: the sorted values plus the int64 sort indices while sorting, then the sorted values,
    their exp and its reversed cumulative sum (the exp is freed as the sum is taken). Counts come
    from ``searchsorted``, never from summing a bool block (that casts it to int64). Returns
    ``thr`` ``[c]``, ``mass`` ``[c]``. Naive equivalent: the HF ``TopKLogitsWarper`` ->
    ``TopPLogitsWarper`` -> ``MinPLogitsWarper`` mask, with ties at each boundary kept.
    """
    vocab = z.shape[1]
    asc = torch.sort(z, dim=1).values  # [c, V] ascending; the int64 indices are dropped
    thr = torch.full(z.shape[:1], -math.inf, dtype=z.dtype, device=z.device)  # [c]
    k = sampling.top_k_for(vocab)
    if k:
        thr = asc[:, vocab - k]  # [c] k-th largest, ties kept
    desc = asc.exp()  # [c, V]
    if k:
        desc.masked_fill_(asc < thr[:, None], 0.0)
    desc = desc.flip(1)  # [c, V] largest first (a copy; the ascending exp is freed)
    cum = desc.cumsum_(dim=1)  # [c, V] mass of the top i+1 kept tokens, non-decreasing
    if sampling.top_p < 1.0:
        target = cum[:, -1:] * sampling.top_p  # [c, 1]
        # The first descending position whose cumulative mass reaches top_p: the last one kept.
        last = torch.searchsorted(cum, target).clamp_(max=vocab - 1)  # [c, 1]
        thr = torch.maximum(thr, asc.gather(1, vocab - 1 - last).squeeze(1))  # [c] ties kept
    if sampling.min_p > 0.0:
        thr = thr.clamp(min=math.log(sampling.min_p))  # [c]
    kept = vocab - torch.searchsorted(asc, thr[:, None].contiguous())  # [c, 1] count >= thr
    mass = cum.gather(1, (kept - 1).clamp_(min=0)).squeeze(1)  # [c]
    return thr, mass


def processed_logps(z_label: torch.Tensor, thr: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """``z_label - log(mass)`` where the label is in the support (``z_label >= thr``), else -inf.

    All ``[c]``. Naive equivalent: ``log_softmax(logits.masked_fill(~keep, -inf)).gather(label)``.
    """
    inside = z_label >= thr  # [c]
    return torch.where(inside, z_label - mass.log(), torch.full_like(z_label, -math.inf))  # [c]
