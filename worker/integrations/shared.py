"""One ``AsyncScoringClient`` and its ``Coalescer`` per event loop and queue, shared by every
call in a process: per-sample reward calls (verl's ``compute_score``) become fleet-sized jobs,
and a trainer that calls from its own long-lived loop (TRL's ``async_loop``) reuses one reply
stream instead of opening one per call."""

from __future__ import annotations

import asyncio
import weakref

from worker.client.aio import AsyncScoringClient
from worker.client.coalesce import Coalescer
from worker.config import DEFAULT_REDIS_URL, env_get

_Shared = dict[tuple[str, str, int], Coalescer]
_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Shared] = (
    weakref.WeakKeyDictionary()
)


def settings(redis_url: str | None, queue: str | None) -> tuple[str, str]:
    """The Redis URL and queue of a call: the arguments, else ``SCORING_REDIS_URL`` /
    ``SCORING_QUEUE`` (read at call time, never at import), else the defaults."""
    url = redis_url or env_get("REDIS_URL") or DEFAULT_REDIS_URL
    return url, queue or env_get("QUEUE") or "default"


def coalescer(
    redis_url: str, queue: str, partitions: int = 1, *, window_ms: float = 2.0
) -> Coalescer:
    """The running loop's coalescer for ``(redis_url, queue, partitions)`` (made on first use)."""
    loop = asyncio.get_running_loop()
    per_loop = _BY_LOOP.setdefault(loop, {})
    key = (redis_url, queue, partitions)
    found = per_loop.get(key)
    if found is None or found.client._core.closed:
        client = AsyncScoringClient(
            redis_url, queue=queue, partitions=partitions, resubmit_after_s=60.0
        )
        found = per_loop[key] = Coalescer(client, window_s=window_ms / 1000.0, max_seqs=1024)
    return found


async def close_all() -> None:
    """Close the running loop's shared clients (their reply streams go)."""
    loop = asyncio.get_running_loop()
    for c in _BY_LOOP.pop(loop, {}).values():
        await c.close()
        await c.client.close()
