"""A Tinker prompt's chunks as token ids and images: ``encoded_text`` chunks give their
``tokens``; an ``image`` chunk (``tinker/types/image_chunk.py``: ``data`` base64, ``format``
``"png"`` or ``"jpeg"``, ``expected_tokens``) becomes a run of ``expected_tokens`` copies of the
served model's image token (``--image-token-id``) and one image of the job, shown by that run.

Where the count is known: the worker alone runs the model's image processor. The gateway expands
the chunk to the count the SDK states (``expected_tokens``: tinker-cookbook's renderers fill it
from the same processor, and the SDK needs it for ``ModelInput.length``), and the worker checks
each run against its processor's count for that image before any forward: a mismatch is the
worker's ``bad_request`` naming the image and both counts, answered to the SDK as a user error.
A chunk without ``expected_tokens`` is refused here (the gateway has no processor to count with).
The text around a chunk (Qwen's ``<|vision_start|>`` / ``<|vision_end|>``) is the renderer's, as
tinker-cookbook's renderers put it in ``encoded_text`` chunks. ``image_asset_pointer`` chunks
name a location and are refused: a job's images are data, never addresses.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from worker.gateway.errors import GatewayError

#: The first bytes of each format an image chunk may declare.
MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "jpeg": b"\xff\xd8\xff"}
#: Image tokens one chunk may expand to, at most (a bound on what the gateway builds).
MAX_IMAGE_TOKENS = 1 << 16


def _user(message: str) -> GatewayError:
    return GatewayError("bad_request", message)


@dataclass(frozen=True)
class PromptInput:
    """A prompt as one sequence: ``tokens`` (image runs expanded), ``images`` (each image
    chunk's file, in order: run ``k`` shows ``images[k]``) and ``image_token`` (None: no image)."""

    tokens: list[int]
    images: tuple[bytes, ...] = ()
    image_token: int | None = None


def image_file(chunk: dict[str, Any], i: int) -> tuple[bytes, int]:
    """The file and token count of image chunk ``i`` (checked)."""
    fmt, data, expected = chunk.get("format"), chunk.get("data"), chunk.get("expected_tokens")
    if fmt not in MAGIC:
        raise _user(f"prompt chunk {i}: format must be 'png' or 'jpeg', got {fmt!r}")
    if not isinstance(data, str) or not data:
        raise _user(f"prompt chunk {i}: data must be the image file as base64")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise _user(f"prompt chunk {i}: data is not base64") from None
    if not raw.startswith(MAGIC[fmt]):
        raise _user(f"prompt chunk {i}: data is not a {fmt} file (format says {fmt!r})")
    if expected is None:
        raise _user(
            f"prompt chunk {i}: expected_tokens is required (the image-token count, which the "
            "workers check against the model's processor; the gateway runs no processor)"
        )
    if isinstance(expected, bool) or not isinstance(expected, int):
        raise _user(f"prompt chunk {i}: expected_tokens must be an integer")
    if not 1 <= expected <= MAX_IMAGE_TOKENS:
        raise _user(f"prompt chunk {i}: expected_tokens must be 1..{MAX_IMAGE_TOKENS}")
    return raw, expected


def prompt_input(chunks: list[dict[str, Any]], image_token: int | None) -> PromptInput:
    """The prompt of ``chunks`` (module docstring); ``GatewayError("bad_request")`` for a chunk
    that is not served, or an image chunk when the gateway has no ``image_token``."""
    tokens: list[int] = []
    files: list[bytes] = []
    for i, chunk in enumerate(chunks):
        kind = chunk.get("type", "encoded_text")
        if kind == "image":
            if image_token is None:
                raise _user(
                    f"prompt chunk {i} is an image: this gateway has no image token "
                    "(start it with --image-token-id for a vision-language model)"
                )
            raw, n = image_file(chunk, i)
            files.append(raw)
            tokens.extend([image_token] * n)
            continue
        if kind != "encoded_text":
            raise _user(
                f"prompt chunk {i} is {kind!r}: only encoded_text (token ids) and image (the "
                "file's bytes) are served; an asset pointer names a location, never fetched"
            )
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in ids
        ):
            raise _user(f"prompt chunk {i}: tokens must be a list of token ids >= 0")
        tokens.extend(ids)
    if files and image_token is not None:
        runs = sum(
            1 for p, t in enumerate(tokens) if t == image_token and (p == 0 or tokens[p - 1] != t)
        )
        if runs != len(files):
            raise _user(
                "two image chunks are adjacent, or text carries the image token: each image "
                "needs its own run (the renderer's vision start/end tokens between them)"
            )
    return PromptInput(tokens, tuple(files), image_token if files else None)
