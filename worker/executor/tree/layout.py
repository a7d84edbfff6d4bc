"""The tree row: one forward holding each shared prefix once, then its continuations.

Row ``r`` of a tree forward is ``[prefix_r (padded to the widest prefix), c1, .., cG, fill]``;
``position_ids`` are ``0 .. P_r - 1`` over the prefix and ``P_r .. P_r + len(ci) - 1`` over every
continuation, so each continuation sees the positions it has in its own sequence. The structure
the attention needs (``TreeLayout``) rides with the batch into ``model(..., scoring_tree=layout)``;
``attention.tree_attention`` reads it. Naive equivalent: every sequence alone in its own row; the
tests and the load check (``check``) assert the two agree.

A sequence ``k`` of a tree forward keeps the ``ForwardBatch`` reading: ``starts[k]`` is the flat
index its token ``P_k`` would have if the whole sequence sat contiguously before its continuation
(``cont_start - P_k``), so ``starts + lengths - 1`` is still its true last token (rewards);
``TreeLayout.flat`` maps any of its positions, prefix ones included, to the row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from worker.executor.packing import ForwardBatch
from worker.executor.tree.trie import SharedGroup


@dataclass(frozen=True)
class TreeLayout:
    """Where the prefixes and continuations of a tree forward sit (tensors on the batch's device).

    ``prefix_lens`` ``[R]``: each row's prefix; ``prefix_width``: the widest (prefix region
    columns). ``cont_index`` ``[N, C]``: flat ``[R * T]`` index of continuation ``n``'s token ``j``
    (padding: any index, masked by ``cont_valid`` ``[N, C]``); ``cont_row`` ``[N]``: its row.
    ``kernel``: ``"sdpa"`` or ``"eager"`` (which math ``tree_attention`` runs). ``windows``: the
    sliding window of every attention call that read this layout (the load check reads them).
    """

    prefix_lens: torch.Tensor  # [R] int64
    prefix_width: int
    cont_index: torch.Tensor  # [N, C] int64
    cont_valid: torch.Tensor  # [N, C] bool
    cont_row: torch.Tensor  # [N] int64
    host_rows: np.ndarray  # [B] row of each sequence (host)
    host_prefix: np.ndarray  # [B] prefix length of each sequence (host)
    host_starts: np.ndarray  # [B] virtual start of each sequence (host)
    width: int  # T, the row width
    kernel: str = "sdpa"
    windows: list[int | None] = field(default_factory=list)

    def flat(self, k: int, positions: np.ndarray) -> np.ndarray:
        """Flat row indices of sequence ``k``'s ``positions`` (prefix ones in its row's prefix
        region, the rest in its continuation)."""
        in_prefix = positions < self.host_prefix[k]
        return np.where(
            in_prefix, self.host_rows[k] * self.width + positions, self.host_starts[k] + positions
        )

    def to(self, device: torch.device | str) -> TreeLayout:
        """The same layout with its tensors on ``device``."""
        return replace(
            self,
            prefix_lens=self.prefix_lens.to(device),
            cont_index=self.cont_index.to(device),
            cont_valid=self.cont_valid.to(device),
            cont_row=self.cont_row.to(device),
        )

    def cont_positions(self) -> torch.Tensor:
        """Position of every continuation slot, ``[N, C]``: ``P_row + j``."""
        cols = torch.arange(self.cont_index.shape[1], device=self.cont_index.device)  # [C]
        return self.prefix_lens[self.cont_row][:, None] + cols[None, :]  # [N, C]


def tree_batch(
    seqs: Sequence[np.ndarray], rows: Sequence[SharedGroup], seq_ids: Sequence[int]
) -> tuple[ForwardBatch, list[int]]:
    """One forward of tree rows (module docstring): the batch (its ``tree`` set) and the order of
    its sequences (indices into ``seqs``, batch order). ``rows``' members index ``seqs``;
    ``seq_ids[i]`` is the caller's id of ``seqs[i]``."""
    width_p = max(g.prefix_len for g in rows)
    widths = [width_p + sum(len(seqs[i]) - g.prefix_len for i in g.members) for g in rows]
    width = max(widths)
    ids = np.zeros((len(rows), width), dtype=np.int64)  # [R, T]
    pos = np.zeros((len(rows), width), dtype=np.int64)  # [R, T]
    longest = max(len(seqs[i]) - g.prefix_len for g in rows for i in g.members)
    n_cont = sum(len(g.members) for g in rows)
    cont_index = np.zeros((n_cont, longest), dtype=np.int64)  # [N, C]
    cont_valid = np.zeros((n_cont, longest), dtype=bool)  # [N, C]
    cont_row = np.zeros(n_cont, dtype=np.int64)  # [N]
    order, starts, lengths, host_rows, host_prefix = [], [], [], [], []
    n = 0
    for r, group in enumerate(rows):
        p = group.prefix_len
        first = seqs[group.members[0]]
        ids[r, :p] = first[:p]
        pos[r, :width_p] = np.arange(width_p)
        col = width_p
        for i in group.members:
            seq = seqs[i]
            cont = len(seq) - p
            ids[r, col : col + cont] = seq[p:]
            pos[r, col : col + cont] = np.arange(p, len(seq))
            cont_index[n, :cont] = r * width + col + np.arange(cont)
            cont_valid[n, :cont] = True
            cont_row[n] = r
            order.append(i)
            starts.append(r * width + col - p)
            lengths.append(len(seq))
            host_rows.append(r)
            host_prefix.append(p)
            col += cont
            n += 1
    layout = TreeLayout(
        prefix_lens=torch.tensor([g.prefix_len for g in rows], dtype=torch.int64),
        prefix_width=width_p,
        cont_index=torch.from_numpy(cont_index),
        cont_valid=torch.from_numpy(cont_valid),
        cont_row=torch.from_numpy(cont_row),
        host_rows=np.array(host_rows, dtype=np.int64),
        host_prefix=np.array(host_prefix, dtype=np.int64),
        host_starts=np.array(starts, dtype=np.int64),
        width=width,
    )
    batch = ForwardBatch(
        input_ids=torch.from_numpy(ids),
        position_ids=torch.from_numpy(pos),
        attention_mask=None,
        starts=torch.tensor(starts, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64),
        seq_ids=tuple(seq_ids[i] for i in order),
        packed=False,
        tree=layout,
    )
    return batch, order


def unique_tokens(rows: Sequence[SharedGroup], lengths: Sequence[int]) -> int:
    """Real tokens a tree forward computes: each prefix once, each continuation once."""
    return sum(g.unique_tokens(lengths) for g in rows)
