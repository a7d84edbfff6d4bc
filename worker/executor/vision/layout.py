"""Image sequences in every batch layout: their positions and images laid over a text layout,
and the keys that let prefix trees share an image prompt.

``vision_layout`` takes a batch laid out for text (``packing.pad``, ``pad_unmasked``,
``pack_rows`` or ``tree.layout.tree_batch``) and its sequences in batch order, and sets what an
image sequence needs beside its ids:

- positions by the model's own rule, computed per sequence at intake (``intake``), placed on
  every token of the sequence through the batch's own map (``ForwardBatch.flat_index``): a
  shared tree node's tokens get the (identical) positions of each member that reads them. For
  Qwen's mRoPE that is ``[3, R, T]``; packed rows get ``[4, R, T]``, row 0 the text positions
  restarting at each sequence (what transformers reads to separate the sequences of a row: with
  three rows it would see one sequence and attention would leak across them), rows 1-3 the
  mRoPE of each sequence alone (never computed over the row). Other models keep the layout's
  ``0 .. L-1`` positions.
- the batch's images in the order their tokens appear in the flattened rows (the order the
  model's ``masked_scatter`` fills them), each image of a shared tree node once.

``share_keys`` gives the ids prefix trees compare: an image's tokens replaced by a key of that
image (its content digest and grid), so two prompts that differ only in their image never share
its tokens, and one image shown to a whole GRPO group is one shared node (its tokens, and its
vision-tower features, computed once). ``cuts_image`` tells a tree whose node would end inside
an image (its features would be split over segments): such trees are not run.

Naive equivalent: each sequence alone through the model with its processor's output and
positions (``tests/executor/test_vision_layouts.py``; the load check ``check`` compares packed and
tree rows on the real device and dtype).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from worker.executor.packing import ForwardBatch
from worker.executor.tree.trie import SharedGroup, shared_groups
from worker.executor.vision.features import image_key
from worker.scorer.inputs import PreparedSequence

IMAGE_KEY_BASE = 1 << 40
"""Keys of images in ``share_keys``: far above any vocabulary id."""


def image_slots(seq: PreparedSequence, image_token: int) -> np.ndarray:
    """Per image token of ``seq`` (in order), the index of its image in ``seq.vision.images``:
    each image owns the next ``tokens`` image tokens (runs checked at intake)."""
    assert seq.vision is not None
    counts = [img.tokens for img in seq.vision.images]
    return np.repeat(np.arange(len(counts), dtype=np.int64), counts)


def vision_layout(
    batch: ForwardBatch, ordered: Sequence[PreparedSequence], image_token: int, *, mrope: bool
) -> ForwardBatch:
    """``batch`` with the positions and images of its sequences ``ordered`` (batch order)
    (module docstring) for a model with (``mrope``) or without 3-row positions; unchanged when
    none has images, except packed rows of an mRoPE model, which always get 4-row positions
    (text-only sequences too: with 2-D positions the model would expand them to three rows and
    see one sequence per row)."""
    if not any(s.vision is not None for s in ordered) and not (mrope and batch.packed):
        return batch
    rows, width = batch.input_ids.shape
    every = batch.flat_index([np.arange(len(s.ids), dtype=np.int64) for s in ordered])
    firsts: dict[int, Any] = {}  # flat index of an image's first token -> the image
    rope = np.zeros((3, rows * width), dtype=np.int64)  # [3, R*T]
    at = 0
    for seq in ordered:
        n = len(seq.ids)
        flat = every[at : at + n]
        at += n
        if seq.vision is None:
            rope[:, flat] = np.arange(n)
            continue
        rope[:, flat] = seq.vision.positions  # [3, L] or [L] (broadcast)
        where = np.flatnonzero(seq.ids == image_token)  # [image tokens]
        slots = image_slots(seq, image_token)
        if len(where) != len(slots):
            raise AssertionError("image tokens and images disagree after intake")
        starts = (
            where[np.concatenate([[0], np.flatnonzero(np.diff(slots)) + 1])]
            if len(slots)
            else where
        )
        for pos, img in zip(starts, seq.vision.images, strict=True):
            firsts.setdefault(int(flat[pos]), img)
    images = tuple(firsts[k] for k in sorted(firsts))
    if not mrope:
        return replace(batch, images=images)
    laid = torch.from_numpy(rope.reshape(3, rows, width))  # [3, R, T]
    if batch.packed:  # row 0: the text positions that separate the row's sequences
        laid = torch.cat([batch.position_ids[None], laid])  # [4, R, T]
    return replace(batch, position_ids=laid, images=images)


def with_images(vlm: Any, batch: ForwardBatch, ordered: Sequence[PreparedSequence]) -> ForwardBatch:
    """``vision_layout`` of ``batch`` for the served ``VisionModel`` ``vlm``; ``batch`` itself
    for a text-only model (``None``)."""
    if vlm is None:
        return batch
    return vision_layout(batch, ordered, vlm.image_token, mrope=vlm.mrope)


def share_keys(seqs: Sequence[PreparedSequence], image_token: int) -> list[np.ndarray]:
    """The ids prefix trees compare (module docstring): each image token replaced by
    ``IMAGE_KEY_BASE`` + the index of its image's content and grid among the call's images."""
    known: dict[str, int] = {}
    out = []
    for seq in seqs:
        if seq.vision is None:
            out.append(seq.ids)
            continue
        keys = seq.ids.copy()
        where = np.flatnonzero(seq.ids == image_token)
        codes = [
            IMAGE_KEY_BASE + known.setdefault(image_key(img), len(known))
            for img in seq.vision.images
        ]
        keys[where] = np.asarray(codes, dtype=np.int64)[image_slots(seq, image_token)]
        out.append(keys)
    return out


@dataclass(frozen=True)
class ImageLayouts:
    """Which layouts image sequences run in, settled at load by the image check (``check``):
    ``packed`` rows, ``unmasked`` buckets and ``tree`` rows (prefix sharing), each ``False``
    with its reason in ``why`` (masked ``padded`` buckets always run); ``image_token``: the
    model's placeholder id (0: a text-only model)."""

    packed: bool = False
    unmasked: bool = False
    tree: bool = False
    image_token: int = 0
    why: dict[str, str] = field(default_factory=dict)

    def describe(self) -> dict[str, str]:
        """What results' ``info.vision`` says of the layouts image sequences run in."""
        ran = [name for name in ("packed", "unmasked") if getattr(self, name)] + ["padded"]
        return {
            "layouts": ", ".join(ran),
            **{f"{name}_off": why for name, why in self.why.items()},
            "prefix_sharing": "on" if self.tree else f"off ({self.why.get('tree', '')})",
        }


def image_share_groups(
    seqs: Sequence[PreparedSequence], min_shared: int, image_token: int
) -> list[SharedGroup]:
    """``trie.shared_groups`` over ``share_keys``, without the trees that would cut an image
    (``cuts_image``)."""
    keys = share_keys(seqs, image_token)
    return [g for g in shared_groups(keys, min_shared) if not cuts_image(g, keys)]


def cuts_image(group: SharedGroup, keys: Sequence[np.ndarray]) -> bool:
    """Whether a node of ``group`` ends inside an image: after its first token and at or
    before its last (an image of several runs, SmolVLM's tiles or Mistral-3's rows, spans the
    text between them too)."""
    for k, i in enumerate(group.members):
        seq = keys[i]
        where = np.flatnonzero(seq >= IMAGE_KEY_BASE)
        if not where.size:
            continue
        change = np.flatnonzero(np.diff(seq[where])) + 1  # where the next image starts
        firsts = where[np.concatenate([[0], change])]
        lasts = where[np.concatenate([change - 1, [len(where) - 1]])]
        for j in group.path(k):
            end = group.nodes[j].end
            if bool(np.any((firsts < end) & (end <= lasts))):
                return True
    return False
