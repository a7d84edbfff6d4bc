"""Checks the request types share: a bounded integer (``BadRequest`` naming the field)."""

from __future__ import annotations

import numbers
from typing import Any

from worker.errors import BadRequest


def integer(name: str, value: Any, lo: int, hi: int) -> int:
    """``value`` as an int when it is an integer (not a bool) in ``lo..hi``; else ``BadRequest``
    naming ``name``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or not lo <= int(value) <= hi
    ):
        raise BadRequest(f"{name} must be an integer in {lo}..{hi}, got {value!r}")
    return int(value)
