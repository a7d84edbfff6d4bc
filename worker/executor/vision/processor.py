"""The model's own image processor, run once per distinct image and options.

``ImageProcessing`` wraps the processor loaded from the checkpoint's ``preprocessor_config.json``
(``AutoImageProcessor``): a job's size options (``min_pixels``, ``max_pixels``; Qwen2-VL's
processor only, the others take none) are checked against what that processor has (an option
it lacks is a ``BadRequest``), and each image's output (``pixel_values``, its grid, its token
count by the model's rule, ``arch.VisionModel.count``) is cached by the file's content hash and the
options, so an image shown by many sequences, or sent again by the next job, is processed once.
Outputs are host numpy arrays (a prepared request stays torch-free and picklable).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from worker.errors import BadRequest, ConfigError
from worker.executor.vision.arch import has_vision
from worker.executor.vision.decode import Decoded

# the processor's ``size`` keys each job option sets
SIZE_KEYS = {"min_pixels": "shortest_edge", "max_pixels": "longest_edge"}


class Counter(Protocol):
    """The model's rule for an image's token count (``arch.VisionModel``)."""

    @property
    def mrope(self) -> bool: ...

    @property
    def process_options(self) -> dict[str, Any]: ...

    def count(self, out: Any) -> tuple[tuple[int, int, int], tuple[int, ...]]: ...

    def kept(self, out: Any) -> np.ndarray: ...


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the model's processor made it: ``pixel_values`` float32 (Qwen's
    ``[patches, D]``, the others' per ``VisionModel.kept``), ``grid`` (Qwen's ``(t, h, w)`` in
    patches, ``VisionModel.count`` for the others), ``tokens`` its image-token count,
    ``digest`` the content hash of its file, ``runs`` its image-token count per run of the image
    token in order (``(tokens,)``: one run, when not given)."""

    pixel_values: np.ndarray
    grid: tuple[int, int, int]
    tokens: int
    digest: str
    runs: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.runs:
            object.__setattr__(self, "runs", (self.tokens,))


def backend_of(processor: Any) -> str:
    """``pil`` or ``torchvision``: which image library the processor computes with."""
    names = [c.__name__ for c in type(processor).__mro__]
    if "TorchvisionBackend" in names:
        return "torchvision"
    return "pil" if "PilBackend" in names else type(processor).__module__


class ImageProcessing:
    """The model's image processor with a cache (see the module docstring); thread-safe.

    ``processor``: a transformers image processor (Qwen2-VL's: with ``size`` ``shortest_edge`` /
    ``longest_edge``; the others' take no job option, and Gemma-3's pan-and-scan is refused;
    SmolVLM's / Idefics3's image splitting is served: each tile a run);
    ``rule``: the model's token-count rule (``arch.VisionModel``);
    ``cache_images`` / ``cache_bytes``: how many processed images, and how many bytes of their
    ``pixel_values``, are kept (least recently used dropped first; one image at the default
    ``max_pixels`` of Qwen2-VL is up to 77 MB); ``threads``: how many images of a job are
    decoded and processed at once (``pool``: ``None`` for one, one at a time on the caller's
    thread; its idle threads end when this object is collected, as ``ThreadPoolExecutor``'s
    do)."""

    def __init__(
        self,
        processor: Any,
        rule: Counter,
        *,
        cache_images: int = 256,
        cache_bytes: int = 2**30,
        threads: int = 1,
    ) -> None:
        size: Any = getattr(processor, "size", None)
        self.keys = SIZE_KEYS if rule.mrope else {}  # the job options this processor takes
        if rule.mrope and not all(_size(size, key) for key in SIZE_KEYS.values()):
            raise ConfigError(
                f"{type(processor).__name__}: expected a size with shortest_edge and "
                f"longest_edge (Qwen2-VL's processor), got {size!r}"
            )
        if getattr(processor, "do_pan_and_scan", None):
            raise ConfigError(
                f"{type(processor).__name__}: do_pan_and_scan is not served (its crops add image "
                "runs per image); save the processor with do_pan_and_scan off"
            )
        self.processor = processor
        self.rule = rule
        self.cache_images = cache_images
        self.cache_bytes = cache_bytes
        self._held = 0  # bytes of pixel_values in the cache
        self._cache: OrderedDict[tuple[str, tuple[tuple[str, int], ...]], ProcessedImage] = (
            OrderedDict()
        )
        self._lock = threading.Lock()
        self.pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="scoring-image") if threads > 1 else None
        )

    def describe(self, options: tuple[tuple[str, int], ...] = ()) -> dict[str, Any]:
        """The processor's class, backend and the size options in force with ``options``."""
        used = {name: _size(self.processor.size, key) for name, key in self.keys.items()}
        used.update(dict(options))
        return {
            "processor": type(self.processor).__name__,
            "backend": backend_of(self.processor),
            "options": used,
        }

    def check(self, options: tuple[tuple[str, int], ...]) -> None:
        """``BadRequest`` for an option this processor does not take."""
        for name, _ in options:
            if not self.keys:
                raise BadRequest(
                    f"processor option {name!r}: {type(self.processor).__name__} takes no job "
                    "option (only Qwen2-VL's processor takes min_pixels / max_pixels; Gemma-3's "
                    "do_pan_and_scan is not served)"
                )
            if name not in self.keys:
                raise BadRequest(
                    f"processor option {name!r} is not one of {type(self.processor).__name__}'s "
                    f"{sorted(self.keys)}"
                )

    def process(
        self, image: Decoded, options: tuple[tuple[str, int], ...]
    ) -> tuple[ProcessedImage, bool]:
        """``image`` through the processor with ``options``: (the output, whether it came from
        the cache)."""
        key = (image.digest, options)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit, True
        sized: dict[str, Any] = {}
        if self.keys:
            size = {key: _size(self.processor.size, key) for key in self.keys.values()}
            for name, value in options:
                size[self.keys[name]] = value
            sized["size"] = size
        try:
            out = self.processor(
                images=[image.image], return_tensors="np", **sized, **self.rule.process_options
            )
        except Exception as exc:
            raise BadRequest(f"the image processor refused an image: {exc}"[:300]) from None
        grid, runs = self.rule.count(out)
        done = ProcessedImage(
            pixel_values=self.rule.kept(out),
            grid=grid,
            tokens=sum(runs),
            digest=image.digest,
            runs=runs,
        )
        with self._lock:
            if key not in self._cache:
                self._cache[key] = done
                self._held += done.pixel_values.nbytes
            while len(self._cache) > self.cache_images or (
                self._held > self.cache_bytes and len(self._cache) > 1
            ):
                _, dropped = self._cache.popitem(last=False)
                self._held -= dropped.pixel_values.nbytes
        return done, False


def _size(size: Any, key: str) -> int:
    """``size[key]`` of a processor's ``size`` (a ``SizeDict`` or a dict), 0 when unset."""
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    return int(value or 0)


def image_processor_for(model: Any, name_or_path: str | None) -> Any:
    """The image processor of a loaded ``model`` with a vision tower (from ``name_or_path``),
    ``None`` for a text-only model."""
    if name_or_path is None or not has_vision(getattr(model, "config", None)):
        return None
    return load_image_processor(name_or_path)


def load_image_processor(name_or_path: str) -> Any:
    """The image processor saved with a checkpoint (``preprocessor_config.json``);
    ``ConfigError`` when there is none."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(name_or_path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"{name_or_path!r} is an image-text model but has no image processor "
            f"(preprocessor_config.json): {exc}"[:500]
        ) from exc
