"""A job's encoded image files into RGB images, under the worker's limits.

Only PNG, JPEG and WebP are opened (Pillow tries no other plugin); the width and height are read
from the header, and an image over ``max_pixels`` is refused before a byte of it is
decompressed (a decompression bomb costs a header read). A truncated or corrupt file, an
animated one, or anything Pillow cannot decode is a ``BadRequest`` naming the image. Nothing
here opens a path or a URL: the input is bytes.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass
from typing import Any

from worker.errors import BadRequest

FORMATS = ("PNG", "JPEG", "WEBP")


@dataclass(frozen=True)
class Decoded:
    """One decoded image: its RGB ``image`` (PIL), its ``digest`` (sha256 of the file) and its
    file ``format``."""

    image: Any
    digest: str
    format: str


def digest(data: bytes) -> str:
    """The content hash an image is cached by."""
    return hashlib.sha256(data).hexdigest()


def decode_image(data: bytes, index: int, *, max_pixels: int) -> Decoded:
    """``data`` (an encoded file) as an RGB image; ``BadRequest`` naming ``images[index]`` when
    it is not a PNG, JPEG or WebP, is larger than ``max_pixels``, animated, or does not
    decode."""
    from PIL import Image

    where = f"images[{index}]"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)  # the header only
    except Image.DecompressionBombError as exc:  # Pillow's own bound, far above ours
        raise BadRequest(
            f"{where} is over the worker's limit of {max_pixels} pixels: {exc}"
        ) from None
    except Exception:
        raise BadRequest(f"{where} is not a PNG, JPEG or WebP image") from None
    width, height = img.size
    if width * height > max_pixels:
        raise BadRequest(
            f"{where} is {width}x{height} = {width * height} pixels, over the worker's limit of "
            f"{max_pixels} (serve --max-image-pixels)"
        )
    frames = int(getattr(img, "n_frames", 1))
    if frames > 1:
        raise BadRequest(f"{where} is animated ({frames} frames); send one still image")
    fmt = str(img.format)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img.load()
            rgb = img.convert("RGB")
    except Exception as exc:
        raise BadRequest(f"{where} does not decode ({fmt}): {exc}"[:300]) from None
    return Decoded(image=rgb, digest=digest(data), format=fmt)
