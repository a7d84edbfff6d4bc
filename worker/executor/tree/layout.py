"""The tree row: one forward holding each shared segment once, then the continuations.

Row ``r`` of a tree forward is ``[node_1, .., node_m, c_1, .., c_G, fill]``: its tree's nodes in
pre-order (``trie.SharedGroup``), then each member's continuation. ``position_ids`` are each
token's position in its own sequence (a node's ``start .. end - 1``, a continuation's from its
member's depth on), so every token sees the positions it has alone. A *segment* is a node or a
continuation; its queries attend to the segments above it (its *context*: positions ``0 ..
start - 1``, the nodes on its path) and causally to its own tokens. The structure the attention
needs (``TreeLayout``: segments bucketed by context and own length into ``Block``s) rides with
the batch into ``model(..., scoring_tree=layout)``; ``attention.tree_attention`` reads it. For a
flex ``BlockMask`` it also holds three ``[R, T]`` maps of the row: ``seg``, each token's segment
numbered in its tree's pre-order (a continuation is a leaf below the node it attaches to; fill
``-1``), ``seg_end``, the number after the last segment below the token's own (fill ``-1``), and
``positions``. Key ``k`` is above or beside query ``q`` when ``seg[k] <= seg[q] < seg_end[k]``
(its segment is ``q``'s or one of the nodes above it); every such key that is not ``q``'s own
sits before ``q``'s segment in the row, so ``k <= q`` in the row is the causal part. Naive
equivalent: every sequence alone in its own row; the tests and the load check (``check``)
assert the two agree.

A sequence ``k`` of a tree forward keeps the ``ForwardBatch`` reading: ``starts[k]`` is the flat
index its first token would have if the whole sequence sat contiguously before its continuation
(``cont_start - depth_k``), so ``starts + lengths - 1`` is still its true last token (rewards);
``TreeLayout.flat`` maps any of its positions, node ones included, to the row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from worker.executor.packing import ForwardBatch
from worker.executor.tree.rows import Block, TreeLayout
from worker.executor.tree.trie import SharedGroup


def _bucket(ctx: int, own: int) -> tuple[int, int]:
    """Segments whose context and own lengths are within a factor of two share a block."""
    return ctx.bit_length(), own.bit_length()


def _blocks(segments: list[tuple[int, int, np.ndarray]]) -> tuple[Block, ...]:
    """``(flat start, length, context flat indices)`` of every segment -> ``Block``s."""
    buckets: dict[tuple[int, int], list[tuple[int, int, np.ndarray]]] = {}
    for seg in segments:
        buckets.setdefault(_bucket(len(seg[2]), seg[1]), []).append(seg)
    out = []
    for key in sorted(buckets):
        segs = buckets[key]
        c = max(s[1] for s in segs)
        a = max(len(s[2]) for s in segs)
        own = np.zeros((len(segs), c), dtype=np.int64)  # [n, C]
        ctx = np.zeros((len(segs), a), dtype=np.int64)  # [n, A]
        for n, (start, length, above) in enumerate(segs):
            own[n, :length] = start + np.arange(length)
            ctx[n, : len(above)] = above
        out.append(
            Block(
                own=torch.from_numpy(own),
                own_len=torch.tensor([s[1] for s in segs], dtype=torch.int64),
                ctx=torch.from_numpy(ctx),
                ctx_len=torch.tensor([len(s[2]) for s in segs], dtype=torch.int64),
            )
        )
    return tuple(out)


def tree_batch(
    seqs: Sequence[np.ndarray], rows: Sequence[SharedGroup], seq_ids: Sequence[int]
) -> tuple[ForwardBatch, list[int]]:
    """One forward of tree rows (module docstring): the batch (its ``tree`` set) and the order of
    its sequences (indices into ``seqs``, batch order). ``rows``' members index ``seqs``;
    ``seq_ids[i]`` is the caller's id of ``seqs[i]``."""
    lengths = [len(s) for s in seqs]
    width = max(g.unique_tokens(lengths) for g in rows)
    ids = np.zeros((len(rows), width), dtype=np.int64)  # [R, T]
    pos = np.zeros((len(rows), width), dtype=np.int64)  # [R, T]
    seg = np.full((len(rows), width), -1, dtype=np.int64)  # [R, T]
    seg_end = np.full((len(rows), width), -1, dtype=np.int64)  # [R, T]
    segments: list[tuple[int, int, np.ndarray]] = []
    order, starts, pieces = [], [], []
    for r, group in enumerate(rows):
        paths = [group.path(k) for k in range(len(group.members))]
        numbers = _preorder(group)
        node_at: list[int] = []  # flat start of each node
        col = 0
        for j, node in enumerate(group.nodes):
            source = seqs[group.members[next(k for k, p in enumerate(paths) if j in p)]]
            ids[r, col : col + len(node)] = source[node.start : node.end]
            pos[r, col : col + len(node)] = np.arange(node.start, node.end)
            seg[r, col : col + len(node)], seg_end[r, col : col + len(node)] = numbers[j]
            node_at.append(r * width + col)
            segments.append((node_at[j], len(node), _above(group, node.parent, node_at)))
            col += len(node)
        for k, i in enumerate(group.members):
            seq, depth = seqs[i], group.depth(k)
            cont = len(seq) - depth
            ids[r, col : col + cont] = seq[depth:]
            pos[r, col : col + cont] = np.arange(depth, len(seq))
            seg[r, col : col + cont], seg_end[r, col : col + cont] = numbers[len(group.nodes) + k]
            segments.append((r * width + col, cont, _above(group, group.attach[k], node_at)))
            first = [group.nodes[j].start for j in paths[k]] + [depth]
            flat = [node_at[j] for j in paths[k]] + [r * width + col]
            pieces.append((np.array(first, dtype=np.int64), np.array(flat, dtype=np.int64)))
            order.append(i)
            starts.append(r * width + col - depth)
            col += cont
    layout = TreeLayout(
        blocks=_blocks(segments),
        host_pieces=tuple(pieces),
        host_starts=np.array(starts, dtype=np.int64),
        width=width,
        seg=torch.from_numpy(seg),
        seg_end=torch.from_numpy(seg_end),
        positions=torch.from_numpy(pos),
    )
    batch = ForwardBatch(
        input_ids=torch.from_numpy(ids),
        position_ids=torch.from_numpy(pos),
        attention_mask=None,
        starts=torch.tensor(starts, dtype=torch.int64),
        lengths=torch.tensor([lengths[i] for i in order], dtype=torch.int64),
        seq_ids=tuple(seq_ids[i] for i in order),
        packed=False,
        tree=layout,
    )
    return batch, order


def _preorder(group: SharedGroup) -> list[tuple[int, int]]:
    """``(number, end)`` of each segment of ``group``'s row: its nodes, then its members'
    continuations (a leaf below the node each attaches to), numbered in pre-order; ``end``: the
    number after the last segment below it. Segment ``a`` is ``b`` or above it exactly when
    ``number_a <= number_b < end_a``."""
    below: list[list[int]] = [[] for _ in group.nodes]  # segments right below each node
    roots = [j for j, node in enumerate(group.nodes) if node.parent < 0]
    for j, node in enumerate(group.nodes):
        if node.parent >= 0:
            below[node.parent].append(j)
    for k, j in enumerate(group.attach):
        below[j].append(len(group.nodes) + k)
    out = [(0, 0)] * (len(group.nodes) + len(group.members))
    count = 0

    def visit(s: int) -> None:
        nonlocal count
        first = count
        count += 1
        for t in below[s] if s < len(group.nodes) else ():
            visit(t)
        out[s] = (first, count)

    for j in roots:
        visit(j)
    return out


def _above(group: SharedGroup, node: int, node_at: list[int]) -> np.ndarray:
    """Flat indices of the tokens of ``node`` and every node above it, positions in order."""
    parts = [node_at[j] + np.arange(len(group.nodes[j])) for j in group.chain(node)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
