"""What the vision tests share: image files made here, sequences with expanded placeholders, and
the naive reference (each sequence alone through transformers with its processor's output and
the model's own ``get_rope_index`` positions)."""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from worker.demo.tiny import VLM_TOKENS

START, END, IMAGE, VIDEO = (
    VLM_TOKENS["vision_start_token_id"],
    VLM_TOKENS["vision_end_token_id"],
    VLM_TOKENS["image_token_id"],
    VLM_TOKENS["video_token_id"],
)


def image_file(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A random RGB image of ``width x height`` encoded as ``fmt``."""
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG claiming ``width x height`` with the start of its compressed zeros: what a
    decompression bomb shows before it is decoded (a few hundred bytes)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    zeros = zlib.compress(b"\0" * 65536, 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zeros)


def image_tokens(processor: Any, data: bytes, **options: int) -> int:
    """How many image tokens the processor makes for the image file ``data``."""
    out = processed(processor, [data], **options)
    return int(out["image_grid_thw"].prod()) // 4  # merge 2 x 2


def processed(processor: Any, files: Sequence[bytes], **options: int) -> Any:
    """The processor's output for ``files`` (decoded as the worker does), torch tensors."""
    images = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    size = {
        "shortest_edge": processor.size.shortest_edge,
        "longest_edge": processor.size.longest_edge,
    }
    if "min_pixels" in options:
        size["shortest_edge"] = options["min_pixels"]
    if "max_pixels" in options:
        size["longest_edge"] = options["max_pixels"]
    return processor(images=images, size=size, return_tensors="pt")


def placeholder(n: int) -> list[int]:
    """One image as trainers hold it: vision start, ``n`` image tokens, vision end."""
    return [START, *[IMAGE] * n, END]


def reference(
    model: Any,
    processor: Any,
    files: Sequence[bytes],
    tokens: Sequence[int],
    refs: Sequence[int],
    *,
    temperature: float = 1.0,
    topk: int = 0,
    **options: int,
) -> dict[str, np.ndarray]:
    """Per position ``t >= 1`` (predicting ``tokens[t]``): ``logps``, ``entropy`` and, with
    ``topk``, ``topk_ids`` / ``topk_logps`` of the temperature-scaled distribution, from one
    forward of the sequence alone with its images (``files[r]`` for ``r`` in ``refs``)."""
    ids = torch.tensor([list(tokens)])
    types = (ids == IMAGE).int()
    extra: dict[str, Any] = {}
    grids = None
    if refs:
        out = processed(processor, [files[r] for r in refs], **options)
        extra = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        grids = out["image_grid_thw"]
    pos, _ = model.model.get_rope_index(ids, types, image_grid_thw=grids)
    with torch.no_grad():
        logits = (
            model(
                input_ids=ids, position_ids=pos, mm_token_type_ids=types, use_cache=False, **extra
            )
            .logits[0, :-1]
            .float()
            / temperature
        )  # [L-1, V]
    logp = logits.log_softmax(-1)
    got = {
        "logps": logp.gather(-1, ids[0, 1:, None])[:, 0].numpy(),
        "entropy": -(logp.exp() * logp).sum(-1).numpy(),
    }
    if topk:
        vals, idx = logp.topk(topk, -1)
        got["topk_logps"], got["topk_ids"] = vals.numpy(), idx.numpy()
    return got
