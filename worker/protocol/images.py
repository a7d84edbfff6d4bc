"""A job's images (protocol v1, additive): ``images``, ``processor`` and each sequence's
``images`` (``docs/protocol.md``, "Images").

``images``: an array of bin, each an encoded image file (PNG, JPEG or WebP), sent once however
many sequences show it. ``processor``: a map of the image processor's size options
(``min_pixels``, ``max_pixels``; ``worker.request.IMAGE_OPTION_NAMES``). ``seqs[i].images``: an
array of indices into the job's ``images``, one per run of the model's image token in the
sequence's tokens (the job's ``prefix`` included), in order of appearance; an index may repeat.
The bytes are not decoded here: the worker decodes them once, under its own limits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from worker.errors import BadRequest, ProtocolError
from worker.request import Images

__all__ = ["decode_images", "decode_seq_images", "encode_images", "encode_seq_images"]


def encode_images(images: Images | None) -> dict[str, Any]:
    """The job-level keys of ``images`` (``{}`` without images)."""
    if images is None:
        return {}
    body: dict[str, Any] = {"images": list(images.files)}
    if images.processor:
        body["processor"] = dict(images.processor)
    return body


def decode_images(body: Mapping[str, Any]) -> Images | None:
    """The job's ``Images`` (``None`` without ``images``); ``ProtocolError`` when malformed."""
    files, options = body.get("images"), body.get("processor")
    if files is None:
        if options is not None:
            raise ProtocolError("processor options given but the job has no images")
        return None
    if not isinstance(files, list) or not all(isinstance(f, bytes) for f in files):
        raise ProtocolError("images must be an array of bin (encoded image files)")
    if options is not None and not isinstance(options, dict):
        raise ProtocolError("processor must be a map of option name -> integer")
    try:
        return Images(tuple(files), options or ())  # type: ignore[arg-type]  # a map is taken
    except BadRequest as exc:
        raise ProtocolError(exc.message) from None


def encode_seq_images(refs: Sequence[int] | None) -> dict[str, Any]:
    """A sequence's ``images`` key (``{}`` when it shows none)."""
    return {} if refs is None else {"images": [int(r) for r in refs]}


def decode_seq_images(raw: Any, index: int) -> tuple[int, ...] | None:
    """``seqs[index].images`` as a tuple of indices (range-checked against the job's images by
    ``worker.request.check_image_refs``)."""
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(
        isinstance(r, int) and not isinstance(r, bool) for r in raw
    ):
        raise ProtocolError(f"seqs[{index}].images must be an array of image indices")
    return tuple(raw)
