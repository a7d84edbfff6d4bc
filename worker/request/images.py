"""``Images``: a job's images (encoded files, sent once per job) and its image-processor options
(``docs/protocol.md``, "Images"); ``check_image_refs``: every index a sequence names is a file of
the job and every file is shown."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from worker.errors import BadRequest
from worker.request.checks import integer

IMAGE_OPTION_NAMES: tuple[str, ...] = ("min_pixels", "max_pixels")
"""Image-processor size options a job may set; a worker refuses those its processor lacks."""


@dataclass(frozen=True)
class Images:
    """A job's images: ``files``, encoded image files (PNG, JPEG or WebP bytes, decoded only by
    the worker, never a path or URL), each sent once however many sequences show it;
    ``processor``: the image processor's size options for this job, ``(name, int > 0)`` pairs
    sorted by name (a mapping is accepted). Raises ``BadRequest`` with the reason."""

    files: tuple[bytes, ...] = ()
    processor: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.files, (str, bytes)) or not isinstance(self.files, Iterable):
            raise BadRequest("images must be a list of encoded image files (bytes)")
        out = []
        for i, f in enumerate(self.files):
            if not isinstance(f, (bytes, bytearray, memoryview)) or not len(f):
                raise BadRequest(f"images[{i}] must be the non-empty bytes of an image file")
            out.append(bytes(f))
        if not out:
            raise BadRequest("images must hold at least one image file")
        object.__setattr__(self, "files", tuple(out))
        raw = self.processor
        opts: dict[str, int] = {}
        for pair in raw.items() if isinstance(raw, dict) else raw:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise BadRequest("processor must be a map of option name -> integer")
            name, value = pair
            if name not in IMAGE_OPTION_NAMES:
                raise BadRequest(
                    f"processor option {name!r} is not one of {list(IMAGE_OPTION_NAMES)}"
                )
            opts[name] = integer(f"processor.{name}", value, 1, 2**31 - 1)
        lo, hi = opts.get("min_pixels"), opts.get("max_pixels")
        if lo is not None and hi is not None and lo > hi:
            raise BadRequest(f"processor.min_pixels {lo} is above max_pixels {hi}")
        object.__setattr__(self, "processor", tuple(sorted(opts.items())))


def check_image_refs(seqs: Sequence[Any], images: Images | None) -> None:
    """``BadRequest`` unless every index a sequence names is one of ``images``' files and every
    file is named by some sequence (an unused image is a mistake, never silently decoded)."""
    n = len(images.files) if images is not None else 0
    used: set[int] = set()
    for i, seq in enumerate(seqs):
        refs = getattr(seq, "images", None)
        if refs is not None and (isinstance(refs, (str, bytes)) or not isinstance(refs, Iterable)):
            raise BadRequest(f"sequence {i}: images must be a list of image indices")
        for r in refs or ():
            if isinstance(r, bool) or not isinstance(r, numbers.Integral) or not 0 <= int(r) < n:
                raise BadRequest(
                    f"sequence {i}: image index {r!r} is out of range (the job has {n} images)"
                )
            used.add(int(r))
    unused = sorted(set(range(n)) - used)
    if unused:
        raise BadRequest(f"images {unused} are not shown by any sequence")
