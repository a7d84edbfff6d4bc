"""Detection of KV-cache outputs in a model's forward output (``use_cache=False`` must not return
one): the cache-like entries and every tensor they hold."""

from __future__ import annotations

from typing import Any

import torch

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
