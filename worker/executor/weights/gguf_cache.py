"""One parse of a GGUF file per load: what transformers' GGUF loader repeats, done once.

transformers (5.x) parses a GGUF file's metadata twice while loading it (``load_gguf_checkpoint``
once for the config, once for the tensors: two ``gguf.GGUFReader`` passes over every metadata
field, the tokenizer's ~100k strings included), and builds ``gguf.TensorNameMap`` once per module
of the model (397 times for SmolLM2-135M, each walking every tensor-name pattern of the
architecture). Both are pure functions of their arguments. Measured on SmolLM2-135M (Q4_1, 2 CPU
cores), they were about three quarters of the load; dequantising the weights the rest
(docs/performance.md, "Cold start").

:func:`shared_gguf_parses` caches both for the duration of one load: ``gguf.GGUFReader`` and
``gguf.get_tensor_name_map`` (transformers imports them from the ``gguf`` package inside each call,
so replacing the package's names reaches them) are swapped for caching stand-ins and put back on
leaving, error or not. The reader of a file is read, never written, by transformers; the cache
holds it (its memory map) only until the load returns.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def shared_gguf_parses() -> Iterator[None]:
    """Inside the block each GGUF file is parsed once and each tensor-name map built once."""
    try:
        import gguf as gguf_module
    except ImportError:  # no GGUF support installed: nothing to share
        yield
        return
    gguf: Any = gguf_module  # its names are replaced for the block
    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (os.path.realpath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map
        readers.clear()


__all__ = ["shared_gguf_parses"]
