"""The trainers' drop-in functions follow the producers' queue rule: a queue no worker ever
served raises ``UnknownQueueError`` at the first call (not after the call's timeout) and writes
nothing; ``wait_for_unknown_queue`` (argument or ``SCORING_WAIT_FOR_UNKNOWN_QUEUE``) waits instead,
and the timeout then says no worker served the queue."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis

from worker import keys
from worker.client import ScoringTimeout, UnknownQueueError
from worker.integrations import trl, verl
from worker.integrations.shared import close_all

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60), pytest.mark.usefixtures("cleanup_keys")]


def _run(call: Callable[[], Awaitable[Any]]) -> Any:
    async def go() -> Any:
        try:
            return await call()
        finally:
            await close_all()

    return asyncio.run(go())


def _calls(url: str, queue: str, **options: Any) -> dict[str, Callable[[], Awaitable[Any]]]:
    rm = trl.reward_function(url, queue=queue, timeout_s=1.0, **options)
    return {
        "trl": lambda: rm(["a prompt "], ["a completion"]),
        "verl": lambda: verl.compute_score(
            "d", "answer", None, None, redis_url=url, queue=queue, timeout_s=1.0, **options
        ),
    }


@pytest.mark.parametrize("which", ["trl", "verl"])
def test_an_unknown_queue_is_refused_at_the_first_call(
    redis_url: str, key_prefix: str, which: str
) -> None:
    started = time.monotonic()
    with pytest.raises(UnknownQueueError, match=key_prefix):
        _run(_calls(redis_url, key_prefix)[which])
    assert time.monotonic() - started < 5
    assert redis.Redis.from_url(redis_url).exists(keys.job_streams(key_prefix)[0]) == 0


@pytest.mark.parametrize("which", ["trl", "verl"])
def test_waiting_anyway_times_out_saying_no_worker_served_it(
    redis_url: str, key_prefix: str, which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SCORING_WAIT_FOR_UNKNOWN_QUEUE", "1")
    with pytest.raises(ScoringTimeout, match=f"no worker served queue '{key_prefix}'"):
        _run(_calls(redis_url, key_prefix)[which])
    assert redis.Redis.from_url(redis_url).xlen(keys.job_streams(key_prefix)[0]) == 1
