"""One ``AsyncScoringClient`` and its ``Coalescer`` per event loop and queue, shared by every
call in a process: per-sample reward calls (verl's ``compute_score``) become fleet-sized jobs,
and a trainer that calls from its own long-lived loop (TRL's ``async_loop``) reuses one reply
stream instead of opening one per call.

Every integration follows the producers' queue rule (``worker.client.workers``): a queue with a
consumer group waits for a worker within the call's timeout; a queue no worker ever served
raises ``UnknownQueueError`` at once, unless ``wait_for_unknown_queue`` (argument, else
``SCORING_WAIT_FOR_UNKNOWN_QUEUE=1``)."""

from __future__ import annotations

import asyncio
import weakref

from worker.client.aio import AsyncScoringClient
from worker.client.coalesce import Coalescer
from worker.config import DEFAULT_REDIS_URL, env_bool, env_get

_Shared = dict[tuple[str, str, int, bool], Coalescer]
_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Shared] = (
    weakref.WeakKeyDictionary()
)


def settings(redis_url: str | None, queue: str | None) -> tuple[str, str]:
    """The Redis URL and queue of a call: the arguments, else ``SCORING_REDIS_URL`` /
    ``SCORING_QUEUE`` (read at call time, never at import), else the defaults."""
    url = redis_url or env_get("REDIS_URL") or DEFAULT_REDIS_URL
    return url, queue or env_get("QUEUE") or "default"


def wait_unknown(value: bool | None) -> bool:
    """Whether calls wait on a queue no worker ever served: ``value``, else
    ``SCORING_WAIT_FOR_UNKNOWN_QUEUE`` (read at call time), else False (refused at once)."""
    if value is not None:
        return bool(value)
    return env_bool(env_get("WAIT_FOR_UNKNOWN_QUEUE"))


def coalescer(
    redis_url: str,
    queue: str,
    partitions: int = 1,
    *,
    window_ms: float = 2.0,
    wait_for_unknown_queue: bool = False,
) -> Coalescer:
    """The running loop's coalescer for ``(redis_url, queue, partitions,
    wait_for_unknown_queue)`` (made on first use)."""
    loop = asyncio.get_running_loop()
    per_loop = _BY_LOOP.setdefault(loop, {})
    key = (redis_url, queue, partitions, wait_for_unknown_queue)
    found = per_loop.get(key)
    if found is None or found.client._core.closed:
        client = AsyncScoringClient(
            redis_url,
            queue=queue,
            partitions=partitions,
            resubmit_after_s=60.0,
            wait_for_unknown_queue=wait_for_unknown_queue,
        )
        found = per_loop[key] = Coalescer(client, window_s=window_ms / 1000.0, max_seqs=1024)
    return found


async def close_all() -> None:
    """Close the running loop's shared clients (their reply streams go)."""
    loop = asyncio.get_running_loop()
    for c in _BY_LOOP.pop(loop, {}).values():
        await c.close()
        await c.client.close()
