"""Batch layouts: padding-free packed rows, length-sorted padded buckets (masked or unmasked).

Pure functions that turn ragged token sequences into the tensors one forward needs
(``input_ids``, ``position_ids``, ``attention_mask``) plus the index maps that bring the
per-token results back to each sequence. No model code lives here.

Packed layout (the fast path): every sequence of a batch is concatenated into one row and
``position_ids`` restart at 0 for each sequence, with ``attention_mask=None``. transformers 5
detects the restarts (``masking_utils.find_packed_sequence_indices``) and builds a block-diagonal
causal mask for sdpa / eager / flex_attention; flash-attention derives ``cu_seqlens`` from the same
position ids. Its naive equivalent is running every sequence alone;
``tests/executor/test_packing.py`` and ``tests/executor/test_math.py`` assert the two agree.

Unmasked buckets (``pad_unmasked`` + ``plan_buckets``): length-sorted sequences right-padded into
``[B, T]`` with ``attention_mask=None`` and ``position_ids`` counting straight through the pads, so
transformers sees neither padding nor packing and sdpa runs its plain causal path (``is_causal``,
no mask tensor). Pads sit after every real token of their row, so under causal attention no real
position attends to one: the scored positions and the true last token are what the sequence alone
gives. A dense mask (a block-diagonal packed row, or a padding mask) instead makes sdpa compute
every ``[T, T]`` score. Naive equivalent: every sequence alone; the executor's load probe and
``tests/executor/test_unmasked.py`` assert they agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from worker.executor.tree.rows import TreeLayout


@dataclass(frozen=True)
class ForwardBatch:
    """The tensors for one forward pass plus the maps back to the sequences.

    ``input_ids``/``position_ids``: ``[R, T]`` (R = 1 when packed). ``attention_mask``: ``[R, T]``
    or ``None`` (packed). ``starts[i]`` is the flat index (into the row-major ``[R * T]`` view)
    of sequence ``i``'s first token; its tokens occupy ``starts[i] .. starts[i] + lengths[i] - 1``.
    ``seq_ids`` are the caller's indices of the sequences in this batch, in batch order.
    """

    input_ids: torch.Tensor  # [R, T] int64
    position_ids: torch.Tensor  # [R, T] int64
    attention_mask: torch.Tensor | None  # [R, T] int64 or None when packed
    starts: torch.Tensor  # [B] int64 flat start of each sequence
    lengths: torch.Tensor  # [B] int64 real lengths
    seq_ids: tuple[int, ...]
    packed: bool
    # tree rows (shared prefixes, ``tree.layout``): the structure the attention reads, else None
    tree: TreeLayout | None = None
    # vision-language models (``vision.features``): the batch's images in order of appearance
    # (host arrays); ``position_ids`` is then ``[3, R, T]`` (mRoPE)
    images: tuple[Any, ...] = ()

    @property
    def real_tokens(self) -> int:
        """Tokens that belong to a sequence (no padding)."""
        return int(self.lengths.sum())

    @property
    def slot_tokens(self) -> int:
        """Tokens the forward pays for, padding included (``R * T``)."""
        return int(self.input_ids.numel())

    @property
    def last_index(self) -> torch.Tensor:
        """Flat index of each sequence's true last token, ``[B]``."""
        return self.starts + self.lengths - 1

    def flat_index(self, positions: Sequence[np.ndarray]) -> np.ndarray:
        """Flat indices (into ``[R * T]``), host side, of ``positions[k]`` of every sequence
        ``k`` (batch order), concatenated: ``starts[k] + positions[k]``, or through a tree
        row's segments."""
        tree = self.tree
        if tree is not None:
            parts = [tree.flat(k, p) for k, p in enumerate(positions)]
        else:
            starts = self.starts.cpu().numpy()
            parts = [st + p for st, p in zip(starts, positions, strict=True)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def to(self, device: torch.device | str) -> ForwardBatch:
        """The same batch with every tensor on ``device``."""
        mask = self.attention_mask.to(device) if self.attention_mask is not None else None
        return ForwardBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            attention_mask=mask,
            starts=self.starts.to(device),
            lengths=self.lengths.to(device),
            seq_ids=self.seq_ids,
            packed=self.packed,
            tree=self.tree.to(device) if self.tree is not None else None,
            images=self.images,
        )


def pack(seqs: Sequence[np.ndarray], seq_ids: Sequence[int]) -> ForwardBatch:
    """Concatenate ``seqs`` into one row with ``position_ids`` restarting per sequence."""
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)  # [B]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)  # [B]
    ids = np.concatenate(seqs).astype(np.int64)  # [S]
    pos = np.arange(ids.size, dtype=np.int64) - np.repeat(starts, lengths)  # [S]
    return ForwardBatch(
        input_ids=torch.from_numpy(ids)[None, :],  # [1, S]
        position_ids=torch.from_numpy(pos)[None, :],  # [1, S]
        attention_mask=None,
        starts=torch.from_numpy(starts),
        lengths=torch.from_numpy(lengths),
        seq_ids=tuple(seq_ids),
        packed=True,
    )


def pack_rows(rows: Sequence[Sequence[np.ndarray]], seq_ids: Sequence[int]) -> ForwardBatch:
    """Several packed rows in one ``[R, T]`` forward; ``seq_ids`` follow the rows' order.

    Each row concatenates its sequences with restarting ``position_ids``; a row shorter than the
    longest is filled with a tail of pad tokens whose positions also restart at 0, so the tail is
    one more isolated pseudo-sequence that no real token attends to (and that is never read).
    With one row this is exactly ``pack``.
    """
    lengths = [len(s) for row in rows for s in row]
    width = max(sum(len(s) for s in row) for row in rows)
    ids = np.zeros((len(rows), width), dtype=np.int64)  # [R, T]
    pos = np.zeros((len(rows), width), dtype=np.int64)  # [R, T]
    starts: list[int] = []
    for r, row in enumerate(rows):
        col = 0
        for seq in row:
            ids[r, col : col + len(seq)] = seq
            pos[r, col : col + len(seq)] = np.arange(len(seq))
            starts.append(r * width + col)
            col += len(seq)
        pos[r, col:] = np.arange(width - col)  # isolated tail
    return ForwardBatch(
        input_ids=torch.from_numpy(ids),
        position_ids=torch.from_numpy(pos),
        attention_mask=None,
        starts=torch.tensor(starts, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64),
        seq_ids=tuple(seq_ids),
        packed=True,
    )


def plan_packed_forwards(
    lengths: Sequence[int], max_batch_tokens: int, row_tokens: int
) -> list[list[list[int]]]:
    """Forwards of packed rows: rows of at most ``row_tokens`` (first-fit decreasing), grouped so
    that ``rows * longest row`` stays within ``max_batch_tokens``. Returns forwards -> rows -> ids.

    Short rows bound the quadratic cost of a dense block-diagonal mask (sdpa/eager); with a
    varlen kernel (flash-attention) ``row_tokens = max_batch_tokens`` gives one row per forward.
    """
    rows = plan_packed(lengths, min(row_tokens, max_batch_tokens))
    row_lengths = [sum(lengths[i] for i in row) for row in rows]
    return [[rows[r] for r in fwd] for fwd in plan_padded(row_lengths, max_batch_tokens)]


def pad(
    seqs: Sequence[np.ndarray], seq_ids: Sequence[int], *, pad_id: int = 0, side: str = "right"
) -> ForwardBatch:
    """Stack ``seqs`` into ``[B, Lmax]`` with an attention mask; positions count real tokens only.

    ``pad_id`` never matters for the results: pad slots are masked out and never read back.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)  # [B]
    width = int(lengths.max())
    ids = np.full((len(seqs), width), pad_id, dtype=np.int64)  # [B, T]
    mask = np.zeros((len(seqs), width), dtype=np.int64)  # [B, T]
    offsets = width - lengths if side == "left" else np.zeros_like(lengths)  # [B]
    for row, (seq, off) in enumerate(zip(seqs, offsets, strict=True)):
        ids[row, off : off + len(seq)] = seq
        mask[row, off : off + len(seq)] = 1
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)  # [B, T]
    starts = np.arange(len(seqs), dtype=np.int64) * width + offsets  # [B]
    return ForwardBatch(
        input_ids=torch.from_numpy(ids),
        position_ids=torch.from_numpy(pos.astype(np.int64)),
        attention_mask=torch.from_numpy(mask),
        starts=torch.from_numpy(starts.astype(np.int64)),
        lengths=torch.from_numpy(lengths),
        seq_ids=tuple(seq_ids),
        packed=False,
    )


def pad_unmasked(
    seqs: Sequence[np.ndarray], seq_ids: Sequence[int], *, pad_id: int = 0
) -> ForwardBatch:
    """Right-pad ``seqs`` into ``[B, Lmax]`` with no attention mask (only for causal attention).

    ``position_ids`` are ``0 .. Lmax - 1`` in every row, pads included: no restart, so transformers
    detects no packed sequences and builds no mask. ``pad_id`` never matters: a pad comes after
    every real token of its row, so causal attention keeps it out of every real position.
    """
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)  # [B]
    width = int(lengths.max())
    ids = np.full((len(seqs), width), pad_id, dtype=np.int64)  # [B, T]
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = seq
    pos = np.tile(np.arange(width, dtype=np.int64), (len(seqs), 1))  # [B, T]
    return ForwardBatch(
        input_ids=torch.from_numpy(ids),
        position_ids=torch.from_numpy(pos),
        attention_mask=None,
        starts=torch.arange(len(seqs), dtype=torch.int64) * width,
        lengths=torch.from_numpy(lengths),
        seq_ids=tuple(seq_ids),
        packed=False,
    )


def plan_buckets(
    lengths: Sequence[int], max_batch_tokens: int, max_pad_fraction: float
) -> list[list[int]]:
    """Length-sorted buckets whose padding stays within ``max_pad_fraction`` of their slots.

    Longest first; a sequence joins the open bucket while ``rows * longest <= max_batch_tokens``
    and ``padding <= max_pad_fraction * rows * longest``, else it opens the next one. Naive
    equivalent: every sequence alone (``max_pad_fraction=0`` with distinct lengths gives exactly
    that; equal lengths still share a forward). ``max_pad_fraction=1`` is ``plan_padded``.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    real = 0  # real tokens of the open bucket
    for i in order:
        if buckets:
            slots = (len(buckets[-1]) + 1) * lengths[buckets[-1][0]]  # sorted: first is longest
            if slots <= max_batch_tokens and slots - real - lengths[i] <= max_pad_fraction * slots:
                buckets[-1].append(i)
                real += lengths[i]
                continue
        buckets.append([i])
        real = lengths[i]
    return buckets


def plan_packed(lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Group sequence indices into packed rows of at most ``max_batch_tokens`` tokens.

    First-fit decreasing over the lengths; a sequence longer than the budget gets a row alone.
    Groups keep no particular order; callers scatter results back by index.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max_batch_tokens - n)
    return bins


def plan_padded(lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Length-sorted padded buckets whose ``rows * longest`` stays within ``max_batch_tokens``.

    Sorting by length keeps padding small; a sequence longer than the budget gets a bucket alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets:
            width = lengths[buckets[-1][0]]  # longest of the bucket: sorted descending
            if (len(buckets[-1]) + 1) * width <= max_batch_tokens:
                buckets[-1].append(i)
                continue
        buckets.append([i])
    return buckets


def gather_flat(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of ``hidden`` ``[R, T, H]`` at flat indices ``index`` ``[N]`` -> ``[N, H]``."""
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)  # [N, H]
