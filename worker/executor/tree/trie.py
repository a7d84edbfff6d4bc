"""Finding what the sequences of one call share: the longest common token prefixes.

``shared_groups`` is a trie over token ids read one level deep: the sequences sorted
lexicographically by their ids are the trie's leaves in order, and the longest common prefix of two
neighbours (the LCP array) is the depth of their deepest common node. A run of neighbours whose
LCPs are all ``>= min_shared`` is one subtree below depth ``min_shared``; its prefix is the run's
smallest LCP. Where splitting the run at that smallest LCP shares more tokens (two groups with long
prefixes of their own under a short common one), the run is split. Naive equivalent:
``naive_groups``, a dict-of-dicts trie walked from the root; the tests assert the two agree.

``plan_trees`` turns the groups into forwards: every group is one row ``[prefix, c1, .., cG]``,
split between its continuations when the row exceeds ``max_batch_tokens``, rows of several groups
sharing a forward while ``rows * longest row`` stays within the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from worker.executor.packing import plan_padded


@dataclass(frozen=True)
class SharedGroup:
    """Sequences (``members``: indices into the call) whose first ``prefix_len`` ids are equal;
    every member is longer than the prefix (its continuation holds at least its last token)."""

    prefix_len: int
    members: tuple[int, ...]

    def unique_tokens(self, lengths: Sequence[int]) -> int:
        """Tokens of the row ``[prefix, c1, .., cG]``: the prefix once, then each continuation."""
        return self.prefix_len + sum(lengths[i] - self.prefix_len for i in self.members)

    @property
    def shared_tokens(self) -> int:
        """Tokens computed once for ``len(members)`` sequences (the prefix)."""
        return self.prefix_len


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two id arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def shared_groups(seqs: Sequence[np.ndarray], min_shared: int) -> list[SharedGroup]:
    """Groups of at least two sequences sharing a prefix of at least ``min_shared`` ids (module
    docstring); a prefix never covers a member whole (it stops one id short of the shortest)."""
    if len(seqs) < 2:
        return []
    # non-negative ids: big-endian bytes sort like the id sequences themselves
    order = sorted(range(len(seqs)), key=lambda i: np.asarray(seqs[i], ">i8").tobytes())
    lcps = [_lcp(seqs[a], seqs[b]) for a, b in pairwise(order)]  # [n - 1]
    groups: list[SharedGroup] = []
    start = 0
    for k in range(len(order)):
        if k == len(lcps) or lcps[k] < min_shared:
            groups.extend(_split(order[start : k + 1], lcps[start:k], seqs, min_shared))
            start = k + 1
    return groups


def _split(
    run: list[int], lcps: list[int], seqs: Sequence[np.ndarray], min_shared: int
) -> list[SharedGroup]:
    """The best one-level grouping of ``run`` (neighbours in sorted order with their ``lcps``):
    the whole run under its common prefix, or the parts between its smallest LCPs, grouped on
    their own, whichever computes fewer tokens."""
    if len(run) < 2:
        return []
    shortest = min(len(seqs[i]) for i in run)
    prefix = min(min(lcps), shortest - 1)
    if prefix < min_shared:
        return []
    whole = [SharedGroup(prefix, tuple(sorted(run)))]
    cut = min(lcps)
    bounds = [0] + [k + 1 for k, v in enumerate(lcps) if v == cut] + [len(run)]
    if len(bounds) == 2:  # nothing to split at
        return whole
    parts = [
        group
        for a, b in pairwise(bounds)
        for group in _split(run[a:b], lcps[a : b - 1], seqs, min_shared)
    ]
    saved_whole = prefix * (len(run) - 1)
    saved_parts = sum(g.prefix_len * (len(g.members) - 1) for g in parts)
    return parts if saved_parts > saved_whole else whole


def naive_groups(seqs: Sequence[np.ndarray], min_shared: int) -> list[tuple[int, set[int]]]:
    """The prefixes a dict trie finds, one level: for every node at depth ``min_shared`` with two
    or more sequences below it, the depth of its deepest node holding them all (capped one id short
    of the shortest) and the sequences. The naive equivalent of ``shared_groups`` without the
    split (tests)."""
    root: dict[int, dict] = {}
    below: dict[int, set[int]] = {}  # id(node) -> sequences through it
    for i, seq in enumerate(seqs):
        node = root
        for tok in seq[:min_shared]:
            node = node.setdefault(int(tok), {})
        if len(seq) >= min_shared:
            below.setdefault(id(node), set()).add(i)
    out = []
    for members in below.values():
        if len(members) < 2:
            continue
        first = seqs[min(members)]
        shortest = min(len(seqs[j]) for j in members)
        depth = min(min(_lcp(first, seqs[j]) for j in members), shortest - 1)
        if depth >= min_shared:
            out.append((depth, members))
    return out


def plan_trees(
    groups: Sequence[SharedGroup], lengths: Sequence[int], max_batch_tokens: int
) -> list[list[SharedGroup]]:
    """Forwards of tree rows: each group one row, a group whose row exceeds ``max_batch_tokens``
    split between its continuations (a part keeps the prefix; a part of one member is dropped,
    ``leftover`` runs it alone), rows grouped with ``plan_padded`` by their unique tokens."""
    rows: list[SharedGroup] = []
    for group in groups:
        part: list[int] = []
        width = group.prefix_len
        for i in group.members:
            extra = lengths[i] - group.prefix_len
            if part and width + extra > max_batch_tokens:
                rows.append(SharedGroup(group.prefix_len, tuple(part)))
                part, width = [], group.prefix_len
            part.append(i)
            width += extra
        rows.append(SharedGroup(group.prefix_len, tuple(part)))
    rows = [r for r in rows if len(r.members) >= 2]
    sizes = [r.unique_tokens(lengths) for r in rows]
    return [[rows[k] for k in fwd] for fwd in plan_padded(sizes, max_batch_tokens)]


def leftover(n: int, forwards: Sequence[Sequence[SharedGroup]]) -> list[int]:
    """Indices among ``n`` sequences that no tree row holds (they run in the usual layouts)."""
    held = {i for fwd in forwards for g in fwd for i in g.members}
    return [i for i in range(n) if i not in held]
