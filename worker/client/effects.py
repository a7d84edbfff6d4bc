"""The effects of the sans-I/O client core (``worker.client.core``): what an operation yields
for the sync or the asyncio client to perform, and what it is sent back.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Command:
    """Run ``redis.<name>(*args, **kwargs)``: its reply is sent back, its error thrown in."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Block:
    """Wait until results arrived after ``seen`` (``ClientCore.arrivals``), the client closes,
    or ``timeout_s`` passes (None: no limit)."""

    timeout_s: float | None
    seen: int


@dataclass(frozen=True)
class DurableAdd:
    """``XADD stream * fields`` then ``WAIT replicas timeout_ms`` on the same connection to the
    stream's primary (``connections.xadd_wait``); ``(entry id, replicas that acked)`` is sent
    back."""

    stream: str
    fields: Mapping[bytes, bytes]
    replicas: int
    timeout_ms: int


@dataclass(frozen=True)
class Pause:
    """Sleep ``seconds``, or less if the client closes (the reader's back-off)."""

    seconds: float


@dataclass(frozen=True)
class Delivered:
    """New results are in the buffer: wake every ``Block``."""


@dataclass(frozen=True)
class NextItem:
    """The next item of ``source`` (an iterator, or an async iterator for the asyncio client) is
    sent back, or ``END`` when it is exhausted."""

    source: Any


END: Any = object()  # what a NextItem effect sends back when its source is exhausted
Effect = Command | DurableAdd | Block | Pause | Delivered | NextItem
#: An operation of the core: yields effects, returns a ``T``.
Steps = Generator[Effect, Any, T]
