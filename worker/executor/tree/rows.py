"""The structure a tree forward's attention reads: ``Block`` (segments of like sizes) and
``TreeLayout`` (where every segment of the row sits). Pure data over torch and numpy: the batch
(``packing.ForwardBatch``) carries a layout, ``layout`` builds one and ``attention`` reads it, so
all three import this module and it imports none of them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class Block:
    """Segments of like sizes attended together (tensors on the batch's device).

    ``own`` ``[n, C]``: flat ``[R * T]`` index of each segment's tokens (its queries and own
    keys; padding: any index, past ``own_len``); ``own_len`` ``[n]``. ``ctx`` ``[n, A]``: flat
    index of the tokens of the nodes above it, positions ``0 .. ctx_len - 1`` in order (padding
    past ``ctx_len``); ``ctx_len`` ``[n]``: also the position of the segment's first token.
    """

    own: torch.Tensor  # [n, C] int64
    own_len: torch.Tensor  # [n] int64
    ctx: torch.Tensor  # [n, A] int64
    ctx_len: torch.Tensor  # [n] int64

    def to(self, device: torch.device | str) -> Block:
        """The same block on ``device``."""
        return Block(
            self.own.to(device), self.own_len.to(device), self.ctx.to(device),
            self.ctx_len.to(device),
        )  # fmt: skip


@dataclass(frozen=True)
class TreeLayout:
    """Where the segments of a tree forward sit.

    ``blocks``: the segments, bucketed by size (``Block``). Host maps of each sequence (batch
    order): ``host_pieces[k]`` = (first position, flat index) of each segment on its path, root
    first, continuation last; ``host_starts[k]``: its virtual start (module docstring).
    ``width``: ``T``. ``seg``, ``seg_end``, ``positions``: the row maps of the module
    docstring. ``kernel``: ``"sdpa"``, ``"eager"`` or ``"flex"`` (which math ``tree_attention``
    runs). ``windows``: the sliding window of every attention call that read this layout (the
    load check reads them). ``masks``: the flex ``BlockMask`` of each window, built by the first
    layer that needs it (``attention.block_mask``), on this layout's device.
    """

    blocks: tuple[Block, ...]
    host_pieces: tuple[tuple[np.ndarray, np.ndarray], ...]
    host_starts: np.ndarray  # [B]
    width: int
    seg: torch.Tensor  # [R, T] int64
    seg_end: torch.Tensor  # [R, T] int64
    positions: torch.Tensor  # [R, T] int64
    kernel: str = "sdpa"
    windows: list[int | None] = field(default_factory=list)
    masks: dict[int | None, Any] = field(default_factory=dict)

    def flat(self, k: int, positions: np.ndarray) -> np.ndarray:
        """Flat row indices of sequence ``k``'s ``positions`` (each in the segment of its path
        that holds it)."""
        first, flat = self.host_pieces[k]
        piece = np.searchsorted(first, positions, side="right") - 1
        return flat[piece] + positions - first[piece]

    def to(self, device: torch.device | str) -> TreeLayout:
        """The same layout with its tensors on ``device`` (no block masks yet)."""
        return replace(
            self,
            blocks=tuple(b.to(device) for b in self.blocks),
            seg=self.seg.to(device),
            seg_end=self.seg_end.to(device),
            positions=self.positions.to(device),
            masks={},
        )
