"""A producer's images: what ``score``, ``score_many`` and ``score_groups`` take as ``images``.

Each image may be the bytes of a PNG, JPEG or WebP file (sent as they are), a path to such a
file (read here, on the producer's side; the worker never opens a path), or a PIL image
(encoded here as PNG, lossless). ``processor``: the job's image-processor size options
(``min_pixels``, ``max_pixels``). Both become one ``worker.request.Images``.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from worker.errors import BadRequest
from worker.request import Images

__all__ = ["caller_images", "image_bytes", "job_images", "merge_images"]


def image_bytes(image: Any) -> bytes:
    """The encoded file of one image: bytes as given, a path's contents, a PIL image as PNG."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        with open(image, "rb") as fh:
            return fh.read()
    if hasattr(image, "save") and hasattr(image, "mode"):  # a PIL image, duck-typed
        out = io.BytesIO()
        image.save(out, format="PNG")
        return out.getvalue()
    raise BadRequest(f"an image must be bytes, a path or a PIL image, got {type(image).__name__}")


def job_images(images: Any, processor: Mapping[str, int] | None = None) -> Images | None:
    """``images`` (a list of bytes / paths / PIL images) and ``processor`` options as the job's
    ``Images``; ``None`` without images."""
    if images is None:
        if processor:
            raise BadRequest("processor options given without images")
        return None
    if isinstance(images, Images):
        return images
    if isinstance(images, (str, bytes)) or not isinstance(images, Iterable):
        raise BadRequest("images must be a list (bytes, paths or PIL images)")
    return Images(tuple(image_bytes(i) for i in images), dict(processor or {}))  # type: ignore[arg-type]


def images_from_base64(items: Any) -> list[bytes]:
    """A JSON line's ``images``: base64 strings of the encoded files (``enqueue``)."""
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise BadRequest("images must be a list of base64 strings (encoded image files)")
    try:
        return [base64.b64decode(i, validate=True) for i in items]
    except ValueError as exc:
        raise BadRequest(f"images: not base64: {exc}") from None


def caller_images(seqs: Sequence[Any], images: Any) -> tuple[bytes, ...]:
    """The encoded files of one caller's ``images`` (``()`` without, or for an empty list);
    ``BadRequest`` when a sequence names an image the caller did not pass (before sending)."""
    given = [] if images is None else list(images)
    files = tuple(image_bytes(i) for i in given)
    for i, seq in enumerate(seqs):
        for r in getattr(seq, "images", None) or ():
            if not 0 <= int(r) < len(files):
                raise BadRequest(
                    f"seqs[{i}]: image index {r} is out of range ({len(files)} images passed)"
                )
    return files


def merge_images(
    parts: Sequence[tuple[Sequence[Any], Sequence[bytes]]],
) -> tuple[list[Any], list[bytes]]:
    """One job's sequences and image files from callers' ``(seqs, files)``: each distinct file
    once (by content, in order of first appearance), each sequence's ``images`` renumbered
    into that list (sequences are ``protocol.SeqSpec``, replaced, never changed)."""
    index: dict[bytes, int] = {}
    seqs: list[Any] = []
    for specs, files in parts:
        at = [index.setdefault(f, len(index)) for f in files]
        for seq in specs:
            refs = getattr(seq, "images", None)
            seqs.append(seq if not refs else replace(seq, images=tuple(at[r] for r in refs)))
    return seqs, list(index)
