"""Finding what the sequences of one call share: a tree of common token prefixes.

``shared_groups`` builds the trie over token ids from the sequences sorted lexicographically (the
trie's leaves in order) and the longest common prefix of each pair of neighbours (the LCP array:
the depth of their deepest common node). A run of neighbours whose LCPs are all at least
``min_shared`` hangs below one node; the run's smallest LCP is that node's depth, and cutting the
run where the LCP equals it gives the node's children, read the same way. A node keeps its own
segment (the ids between its parent's depth and its own) when the segment holds at least
``min_shared`` ids; a shorter one is folded into its children (each computes those few ids
itself). So a GRPO group is one node (the prompt) with its completions below, and agent rollouts
sharing turns are a node per shared turn: every shared segment is computed once.

A member's last id is never shared (a node stops one id short of the shortest sequence below it):
its continuation always holds its true last token. Naive equivalent: ``naive_tree_tokens``, a
dict-of-dicts trie walked from the root, which counts the ids a tree computes when every shared
id is shared; the tests assert the two agree, and that every node is held by its members.

``plan_trees`` turns the groups into forwards: each group one row, a group whose row exceeds
``max_batch_tokens`` split between its members (each part keeps the nodes its members pass
through), rows of several groups sharing a forward while ``rows * longest row`` stays within the
budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from worker.executor.packing import plan_padded


@dataclass(frozen=True)
class Node:
    """A shared segment: positions ``start .. end - 1`` of every sequence below it; ``parent``:
    the index of the node above (its ``end`` is this ``start``), ``-1`` for the root."""

    start: int
    end: int
    parent: int

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SharedGroup:
    """A tree of shared prefixes and the sequences below it.

    ``nodes`` in pre-order (a parent before its children), ``nodes[0]`` the root (``start`` 0);
    ``members``: the sequences (indices into the call); ``attach[k]``: the deepest node member
    ``k`` passes through. Member ``k``'s continuation is its ids from ``nodes[attach[k]].end``
    on (at least its last id). Every node has at least two members below it.
    """

    nodes: tuple[Node, ...]
    members: tuple[int, ...]
    attach: tuple[int, ...]

    @property
    def prefix_len(self) -> int:
        """Ids all members share (the root's segment)."""
        return self.nodes[0].end

    @property
    def shared_tokens(self) -> int:
        """Ids computed once for several sequences (every node's segment)."""
        return sum(len(n) for n in self.nodes)

    def depth(self, k: int) -> int:
        """Ids of member ``k`` (position in ``members``) computed in shared nodes."""
        return self.nodes[self.attach[k]].end

    def chain(self, node: int) -> list[int]:
        """``node`` and the nodes above it, root first (``[]`` for ``-1``)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.nodes[node].parent
        return out[::-1]

    def path(self, k: int) -> list[int]:
        """The nodes member ``k`` (position in ``members``) passes through, root first."""
        return self.chain(self.attach[k])

    def unique_tokens(self, lengths: Sequence[int]) -> int:
        """Ids of the row: every node once, then each member's continuation."""
        return self.shared_tokens + sum(
            lengths[i] - self.depth(k) for k, i in enumerate(self.members)
        )

    def subset(self, keep: Sequence[int]) -> SharedGroup | None:
        """The tree of the members at positions ``keep`` alone: the nodes fewer than two of them
        pass through are dropped (a member then attaches to the deepest node it still shares);
        ``None`` when they share no node."""
        below = [0] * len(self.nodes)
        paths = {k: self.path(k) for k in keep}
        for path in paths.values():
            for node in path:
                below[node] += 1
        kept = [j for j in range(len(self.nodes)) if below[j] >= 2]
        if not kept:
            return None
        index = {j: n for n, j in enumerate(kept)}
        nodes = tuple(
            Node(self.nodes[j].start, self.nodes[j].end, index.get(self.nodes[j].parent, -1))
            for j in kept
        )
        attach = tuple(max((index[j] for j in paths[k] if j in index), default=-1) for k in keep)
        assert all(a >= 0 for a in attach) and nodes[0].parent == -1  # the root is shared by all
        return SharedGroup(nodes, tuple(self.members[k] for k in keep), attach)

    def dfs_order(self) -> list[int]:
        """Member positions in the trie's order (members under one node next to each other)."""
        return sorted(range(len(self.members)), key=lambda k: (self.path(k), k))


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two id arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def shared_groups(seqs: Sequence[np.ndarray], min_shared: int) -> list[SharedGroup]:
    """Trees of at least two sequences sharing segments of at least ``min_shared`` ids (module
    docstring)."""
    if len(seqs) < 2 or min_shared < 1:
        return []
    # non-negative ids: big-endian bytes sort like the id sequences themselves
    order = sorted(range(len(seqs)), key=lambda i: np.asarray(seqs[i], ">i8").tobytes())
    lcps = [_lcp(seqs[a], seqs[b]) for a, b in pairwise(order)]  # [n - 1]
    nodes: list[Node] = []
    attach: dict[int, int] = {}
    start = 0
    for k in range(len(order)):
        if k == len(lcps) or lcps[k] < min_shared:
            if k > start:
                _build(order[start : k + 1], lcps[start:k], seqs, 0, -1, min_shared, nodes, attach)
            start = k + 1
    return _trees(nodes, attach)


def _build(
    run: list[int],
    lcps: list[int],
    seqs: Sequence[np.ndarray],
    base: int,
    parent: int,
    min_shared: int,
    nodes: list[Node],
    attach: dict[int, int],
) -> None:
    """The nodes of ``run`` (at least two neighbours in sorted order, their ``lcps``) below
    ``parent`` (whose segment ends at ``base``), appended to ``nodes`` in pre-order; ``attach``
    gets each member's deepest node."""
    depth = min(min(lcps), min(len(seqs[i]) for i in run) - 1)
    here = parent
    if depth - base >= min_shared:
        nodes.append(Node(base, depth, parent))
        here, base = len(nodes) - 1, depth
    if here >= 0:
        for i in run:
            attach[i] = here
    cut = min(lcps)
    if depth < cut:  # the shortest members are a prefix of the rest: their last id ends here
        rest = [i for i in run if len(seqs[i]) > depth + 1]
        if len(rest) >= 2:
            rest_lcps = [_lcp(seqs[a], seqs[b]) for a, b in pairwise(rest)]
            _build(rest, rest_lcps, seqs, base, here, min_shared, nodes, attach)
        return
    bounds = [0] + [k + 1 for k, v in enumerate(lcps) if v == cut] + [len(run)]
    for a, b in pairwise(bounds):
        if b - a >= 2:
            _build(run[a:b], lcps[a : b - 1], seqs, base, here, min_shared, nodes, attach)


def _trees(nodes: list[Node], attach: dict[int, int]) -> list[SharedGroup]:
    """Split the node forest of ``_build`` into one ``SharedGroup`` per root."""
    root_of: list[int] = []
    for j, node in enumerate(nodes):
        root_of.append(j if node.parent < 0 else root_of[node.parent])
    groups = []
    for root in sorted(set(root_of)):
        ids = [j for j in range(len(nodes)) if root_of[j] == root]
        index = {j: n for n, j in enumerate(ids)}
        tree = tuple(
            Node(nodes[j].start, nodes[j].end, index.get(nodes[j].parent, -1)) for j in ids
        )
        members = sorted(i for i, j in attach.items() if root_of[j] == root)
        groups.append(SharedGroup(tree, tuple(members), tuple(index[attach[i]] for i in members)))
    return groups


def naive_tree_tokens(seqs: Sequence[np.ndarray]) -> int:
    """Ids a tree computes when every id two sequences share is computed once (a dict trie over
    each sequence's ids but its last; every last id on its own): the count ``shared_groups``
    reaches with ``min_shared=1`` (tests)."""
    root: dict[int, dict] = {}
    count = 0
    for seq in seqs:
        node = root
        for tok in seq[:-1]:
            if int(tok) not in node:
                node[int(tok)] = {}
                count += 1
            node = node[int(tok)]
    return count + len(seqs)


def plan_trees(
    groups: Sequence[SharedGroup], lengths: Sequence[int], max_batch_tokens: int
) -> list[list[SharedGroup]]:
    """Forwards of tree rows: each group one row, a group whose row exceeds ``max_batch_tokens``
    split between its members in trie order (a part keeps the nodes its members share; a part
    that shares nothing is dropped, ``leftover`` runs its members alone), rows grouped with
    ``plan_padded`` by their ids."""
    rows: list[SharedGroup] = []
    for group in groups:
        if group.unique_tokens(lengths) <= max_batch_tokens:
            rows.append(group)
            continue
        part: list[int] = []
        held: set[int] = set()
        width = 0
        for k in group.dfs_order():
            new = [j for j in group.path(k) if j not in held]
            extra = sum(len(group.nodes[j]) for j in new)
            extra += lengths[group.members[k]] - group.depth(k)
            if part and width + extra > max_batch_tokens:
                rows += [r for r in [group.subset(part)] if r is not None]
                part, held, width = [], set(), 0
                new = group.path(k)
                extra = lengths[group.members[k]]
            part.append(k)
            held.update(new)
            width += extra
        rows += [r for r in [group.subset(part)] if r is not None]
    sizes = [r.unique_tokens(lengths) for r in rows]
    return [[rows[k] for k in fwd] for fwd in plan_padded(sizes, max_batch_tokens)]


def tree_tokens(groups: Sequence[SharedGroup], lengths: Sequence[int]) -> int:
    """Ids ``groups`` compute, every sequence of ``lengths`` in none of them included: each
    node once, each continuation once, each other sequence whole."""
    held = {i for g in groups for i in g.members}
    alone = sum(n for i, n in enumerate(lengths) if i not in held)
    return alone + sum(g.unique_tokens(lengths) for g in groups)


def leftover(n: int, forwards: Sequence[Sequence[SharedGroup]]) -> list[int]:
    """Indices among ``n`` sequences that no tree row holds (they run in the usual layouts)."""
    held = {i for fwd in forwards for g in fwd for i in g.members}
    return [i for i in range(n) if i not in held]
