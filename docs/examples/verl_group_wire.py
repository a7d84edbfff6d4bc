"""Wire bytes of one GRPO group through verl's reward manager (docs/integrations.md, verl).

A prompt of ``--prompt`` tokens with ``--group`` responses of ``--response`` tokens, as verl
hands them to ``ScoringRewardManager.run_single`` (one sample per call, all at once): scored the
way the manager sent them before groups (each sample's whole ids) and the way it sends them now
(the prompt once, as the job's ``prefix``). Prints the jobs' payload bytes, read back from the
job stream, and checks that the rewards are the same. Needs a worker serving rewards on the
queue (ids are drawn below ``--vocab``).

    python docs/examples/verl_group_wire.py --redis-url redis://127.0.0.1:6379/0 --queue default
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

import redis

from worker import keys
from worker.integrations.shared import close_all, coalescer
from worker.integrations.verl_manager import ScoringRewardManager, sequence_of

TAP = "wire-tap"  # a consumer group that reads nothing: the worker trims no entry it has not read


class Item:
    """One verl data item: left-padded prompt ids, right-padded response ids, their mask."""

    def __init__(self, prompt: list[int], response: list[int]) -> None:
        mask = [1] * (len(prompt) + len(response))
        self.batch = {"prompts": prompt, "responses": response, "attention_mask": mask}


def payload_bytes(
    url: str, queue: str, run: Callable[[], Awaitable[list[float]]]
) -> tuple[int, int, list[float]]:
    """``(jobs, bytes)`` of the payloads ``run`` adds to the queue's job stream, and its
    rewards."""
    r = redis.Redis.from_url(url)
    (stream,) = keys.job_streams(queue)
    r.xgroup_create(stream, TAP, id="$", mkstream=True)
    try:
        (start,) = [
            g["last-delivered-id"] for g in r.xinfo_groups(stream) if g["name"] == TAP.encode()
        ]
        rewards = asyncio.run(run())
        sizes = [len(f[b"payload"]) for _, f in r.xrange(stream, min=b"(" + start)]
    finally:
        r.xgroup_destroy(stream, TAP)
        r.close()
    return len(sizes), sum(sizes), rewards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--queue", default="default")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=259)
    args = ap.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(3, args.vocab) for _ in range(args.prompt)]
    items = [
        Item(prompt, [rng.randrange(3, args.vocab) for _ in range(args.response)])
        for _ in range(args.group)
    ]
    manager = ScoringRewardManager({}, None, redis_url=args.redis_url, queue=args.queue)

    async def before() -> list[float]:  # each sample's whole ids, coalesced into one job
        try:
            batcher = coalescer(manager.redis_url, manager.queue)
            scores = await asyncio.gather(
                *(batcher.score([sequence_of(i)], manager.key, 120) for i in items)
            )
            return [float(s[0].reward) for s in scores]
        finally:
            await close_all()

    async def now() -> list[float]:  # the manager: the prompt once
        try:
            out: list[dict[str, Any]] = await asyncio.gather(
                *(manager.run_single([i]) for i in items)
            )
            return [o["reward_score"] for o in out]
        finally:
            await close_all()

    shape = f"prompt {args.prompt}, {args.group} x {args.response}"
    jobs_b, bytes_b, rewards_b = payload_bytes(args.redis_url, args.queue, before)
    jobs_n, bytes_n, rewards_n = payload_bytes(args.redis_url, args.queue, now)
    print(f"{shape}: before {bytes_b} bytes in {jobs_b} job(s), now {bytes_n} in {jobs_n}")
    assert rewards_n == rewards_b, (rewards_n, rewards_b)


if __name__ == "__main__":
    main()
