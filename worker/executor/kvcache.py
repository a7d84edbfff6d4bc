"""KV-cache outputs (``use_cache=False`` must not return one): detection in a model's forward
output (the cache-like entries and every tensor they hold) and ``KVGuard``, the forward hooks
that tally them per forward and, in warn mode, drop them."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

CACHE_KEYS = ("past_key_values", "cache", "presents", "past_key_value", "cache_params")


def cache_outputs(output: Any) -> list[tuple[Any, Any]]:
    """``(key, value)`` of every cache-like entry in a model output (empty when clean)."""
    from transformers.cache_utils import Cache

    found: list[tuple[Any, Any]] = []
    if isinstance(output, dict):
        items = list(output.items())
    elif isinstance(output, (tuple, list)):
        items = list(enumerate(output))
    else:
        items = [(k, v) for k, v in vars(output).items()] if hasattr(output, "__dict__") else []
    for key, value in items:
        if value is None:
            continue
        if isinstance(value, Cache) or (isinstance(key, str) and key in CACHE_KEYS):
            found.append((key, value))
    return found


def tensors_in(value: Any, depth: int = 0) -> list[torch.Tensor]:
    """Every tensor reachable from a cache object (lists, dicts, attributes), bounded depth."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 6:
        return []
    if isinstance(value, dict):
        children: list[Any] = list(value.values())
    elif isinstance(value, (list, tuple)):
        children = list(value)
    elif hasattr(value, "__dict__"):
        children = list(vars(value).values())
    else:
        return []
    out: list[torch.Tensor] = []
    for child in children:
        out.extend(tensors_in(child, depth + 1))
    return out


@dataclass
class KVTally:
    """KV-cache tensors that one forward returned: ``id(tensor) -> bytes`` (a tensor that two
    hooks see, the body's and the whole model's, counts once). ``drop``: the hooks also remove
    the caches from the outputs (warn mode); else they only count (reject mode)."""

    drop: bool
    seen: dict[int, int] = field(default_factory=dict)

    @property
    def tensors(self) -> int:
        """Number of distinct cache tensors returned."""
        return len(self.seen)

    @property
    def nbytes(self) -> int:
        """Their total size in bytes."""
        return sum(self.seen.values())


class KVGuard:
    """Forward hooks on the served models that tally (and on request drop) KV-cache outputs.

    The hooks are registered once, at construction (``close`` removes them), and do nothing
    outside a ``scope``. A scope belongs to the thread that opens it, so two threads scoring at
    once each see only their own forward's caches, and a model used elsewhere is never touched.
    """

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self._local = threading.local()
        self._hooks = [module.register_forward_hook(self._hook) for module in modules]

    @contextmanager
    def scope(self, *, drop: bool) -> Iterator[KVTally]:
        """Tally the caches of the forward(s) run inside the block (this thread only)."""
        outer = getattr(self._local, "tally", None)
        tally = KVTally(drop=drop)
        self._local.tally = tally
        try:
            yield tally
        finally:
            self._local.tally = outer

    def close(self) -> None:
        """Detach the hooks (the models stay usable elsewhere)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        """Forward hook: tally (and in drop mode remove) any cache object in a model output."""
        tally: KVTally | None = getattr(self._local, "tally", None)
        if tally is None:
            return None
        found = cache_outputs(output)
        if not found:
            return None
        for _, value in found:
            for tensor in tensors_in(value):
                tally.seen[id(tensor)] = tensor.numel() * tensor.element_size()
        if not tally.drop:
            return None
        if isinstance(output, dict):  # ModelOutput: item assignment updates key and attribute
            for key, _ in found:
                output[key] = None
            return output
        if isinstance(output, tuple):
            drop = {key for key, _ in found}
            return tuple(None if i in drop else v for i, v in enumerate(output))
        for key, _ in found:
            setattr(output, key, None)
        return output
