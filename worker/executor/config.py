"""``ExecutorConfig``: the executor's settings, validated once at construction.

Plain data (no torch): every invalid value raises ``ConfigError`` naming the field, so a bad flag
fails at startup rather than on the first batch.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Literal, get_args

from worker.errors import ConfigError
from worker.modes import MODES, Mode
from worker.scorer.inputs import is_int

BACKENDS = ("auto", "flash_attention_2", "flex_attention", "sdpa", "eager")
DTYPES = ("auto", "bfloat16", "float16", "float32")
Layout = Literal["packed", "unmasked", "padded"]
LAYOUTS: tuple[Layout, ...] = get_args(Layout)
PACKINGS = ("auto", *LAYOUTS)
OUTPUT_DTYPES = ("float32", "float64")


@dataclass(frozen=True)
class ExecutorConfig:
    """Executor settings; every invalid value raises ``ConfigError`` at construction.

    ``max_batch_tokens`` bounds one forward (a packed row, or ``rows * longest`` of a padded
    bucket); a single sequence longer than it runs alone. The LM head runs on the scored
    positions in blocks of ``[rows, vocab]`` float32 sized by bytes: ``logprob_chunk_bytes``
    bounds what one block holds at its peak (the float32 logits, plus a half-precision head
    output; teacher outputs count their extra blocks), so memory does not grow with the
    vocabulary (with V = 128,256 the 128 MiB default is 261 rows for log-probs from a float32
    head, 174 from a bf16 one, the same with teacher outputs and no sampler, 104 with a top-k /
    min-p sampler, 40 with a top-p sort); ``logprob_chunk_tokens`` also caps
    the rows of a block (an upper bound). ``head_vocab_tile`` cuts a plain ``nn.Linear`` head
    into vocabulary tiles for log-probs (``tiles.py``: a running logsumexp over ``[rows, tile]``
    slices that stay in cache, rows up to ``logprob_chunk_tokens``); ``None`` = per device:
    1,024 on CPU, 0 (whole-vocabulary blocks) elsewhere. ``native_head`` folds those tiles with
    a small compiled kernel (``native.py``: built with the system C compiler on first use and
    cached; without a compiler, or with ``SCORING_WORKER_NATIVE=0``, torch ops do it, slower).
    ``self_check`` runs a tiny probe at
    construction that compares the fast path against the model's own logits and packed rows against
    one-by-one forwards (packing falls back to padded buckets when they disagree).

    ``packing`` picks the batch layout. ``auto``, per attention backend: packed rows where the
    kernel skips cross-sequence blocks (flash/flex attention, up to the whole budget per row);
    ``unmasked`` buckets on sdpa/eager, whose packed-row or padding masks are dense. ``packed``,
    ``unmasked`` and ``padded`` force one layout (``padded``: length-sorted buckets with an
    attention mask). ``unmasked``: length-sorted, right-padded buckets run with no attention mask
    (sdpa takes its causal path; causal attention keeps the pads out of every real position);
    ``bucket_pad_fraction`` caps the share of a bucket's slots that are padding, ``None`` = per
    device: 0 on CPU (batching saves nothing there, padding costs its share), 0.25 elsewhere.
    ``packed_row_tokens`` caps one packed row for backends that build a dense block-diagonal mask
    (sdpa, eager: attention cost grows with the row length squared); a forward then holds several
    such rows. Flash/flex attention skip the cross-sequence blocks and pack up to the full budget.
    """

    mode: Mode = "reference"
    attention_backend: Literal["auto", "flash_attention_2", "flex_attention", "sdpa", "eager"] = (
        "auto"
    )
    reject_kv_cache_outputs: bool = True
    temperature: float = 1.0
    output_dtype: Literal["float32", "float64"] = "float32"
    max_batch_tokens: int = 16384
    logprob_chunk_tokens: int = 1024
    logprob_chunk_bytes: int = 128 * 1024 * 1024
    device: str = "cpu"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    packing: Literal["auto", "packed", "unmasked", "padded"] = "auto"
    # unmasked buckets: largest padding share of a bucket (None: 0 on CPU, 0.25 elsewhere)
    bucket_pad_fraction: float | None = None
    packed_row_tokens: int = 2048
    # LM-head vocabulary tiles (tiles.py): ids per tile; None: 1,024 on CPU, 0 (off) elsewhere
    head_vocab_tile: int | None = None
    # fold the tiles with the compiled kernel (native.py) where it builds; False: torch ops
    native_head: bool = True
    self_check: bool = True
    # multi-objective reward heads: the output that is ``reward`` (all come back as ``rewards``)
    reward_index: int = 0
    # shared prefixes computed once per forward (``tree``): "auto" when the load check agrees
    prefix_sharing: Literal["auto", "off"] = "auto"
    # shortest prefix worth sharing, in tokens (shorter ones run in the usual layouts)
    min_shared_tokens: int = 32
    # images (vision-language models): the largest image a job may send, width x height in
    # pixels (checked from its header, before decoding), and the most images per job
    max_image_pixels: int = 4096 * 4096
    max_images_per_job: int = 64
    # how many of a job's distinct images are decoded and processed at once at intake
    image_threads: int = 4
    # the vision tower once per distinct image of a call ("on"), or once per image run of
    # every sequence ("off": each sequence's images computed alone, a reference to compare with)
    image_sharing: Literal["on", "off"] = "on"

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"ExecutorConfig.{name}={getattr(self, name)!r}: {why}")

        if self.mode not in MODES:
            raise bad("mode", f"expected one of {MODES}")
        if self.attention_backend not in BACKENDS:
            raise bad("attention_backend", f"expected one of {BACKENDS}")
        if not isinstance(self.reject_kv_cache_outputs, bool):
            raise bad("reject_kv_cache_outputs", "expected a bool")
        if not positive_float(self.temperature):
            raise bad("temperature", "expected a finite number > 0")
        if self.output_dtype not in OUTPUT_DTYPES:
            raise bad("output_dtype", "expected 'float32' or 'float64'")
        for name in (
            "max_batch_tokens",
            "logprob_chunk_tokens",
            "logprob_chunk_bytes",
            "packed_row_tokens",
            "min_shared_tokens",
            "max_image_pixels",
            "max_images_per_job",
            "image_threads",
        ):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise bad(name, "expected an integer >= 1")
        if not is_int(self.reward_index) or self.reward_index < 0:
            raise bad("reward_index", "expected an integer >= 0")
        if not isinstance(self.device, str) or not valid_device(self.device):
            raise bad("device", "expected 'cpu', 'cuda', 'cuda:N' or 'auto'")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"expected one of {DTYPES}")
        if self.packing not in PACKINGS:
            raise bad("packing", f"expected one of {PACKINGS}")
        fraction = self.bucket_pad_fraction
        if fraction is not None and not (
            isinstance(fraction, numbers.Real)
            and not isinstance(fraction, bool)
            and 0.0 <= float(fraction) <= 1.0
        ):
            raise bad("bucket_pad_fraction", "expected None or a number in [0, 1]")
        if self.prefix_sharing not in ("auto", "off"):
            raise bad("prefix_sharing", "expected 'auto' or 'off'")
        if self.image_sharing not in ("on", "off"):
            raise bad("image_sharing", "expected 'on' or 'off'")
        if not isinstance(self.native_head, bool):
            raise bad("native_head", "expected a bool")
        tile = self.head_vocab_tile
        if tile is not None and (not is_int(tile) or tile < 0):
            raise bad("head_vocab_tile", "expected None or an integer >= 0 (0: no tiles)")

    def pad_fraction(self, device_type: str) -> float:
        """Padding share allowed in an unmasked bucket: ``bucket_pad_fraction``, else per device
        (0 on CPU, 0.25 elsewhere)."""
        if self.bucket_pad_fraction is not None:
            return float(self.bucket_pad_fraction)
        return 0.0 if device_type == "cpu" else 0.25

    def vocab_tile(self, device_type: str) -> int:
        """Vocabulary ids per LM-head tile for log-probs (0: whole-vocabulary blocks):
        ``head_vocab_tile``, else per device (1,024 on CPU, where the tiles' reductions stay in
        cache; 0 elsewhere, where one large matmul per block is the fast path)."""
        if self.head_vocab_tile is not None:
            return int(self.head_vocab_tile)
        return 1024 if device_type == "cpu" else 0

    def row_tokens(self, backend: str) -> int:
        """Packed row cap on ``backend``: the whole budget where the kernel skips
        cross-sequence blocks (flash, flex), ``packed_row_tokens`` where it builds a dense mask."""
        if backend.startswith("flash_attention") or backend == "flex_attention":
            return self.max_batch_tokens
        return self.packed_row_tokens


def positive_float(value: Any) -> bool:
    """A real number (not a bool), finite and > 0."""
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
        and float(value) > 0
    )


def valid_device(device: str) -> bool:
    """``cpu``, ``cuda``, ``cuda:N``, ``mps`` or ``auto``."""
    if device in ("cpu", "cuda", "auto", "mps"):
        return True
    head, _, index = device.partition(":")
    return head == "cuda" and index.isdigit()
