"""``Coalescer`` groups: callers that name the prefix their sequences start with share a job that
carries it once; the rest go in one plain job; every caller gets the scores of its whole
sequences (real Redis, the worker double)."""

from __future__ import annotations

import asyncio
from array import array
from typing import Any

import pytest

from tests.support.client import JobTap, Responder, expected_logps
from worker import keys, protocol
from worker.client.aio import AsyncScoringClient
from worker.client.coalesce import BatchKey, Coalescer, _Caller, jobs_of
from worker.client.results import SeqScore
from worker.protocol.seqs import le_bytes

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30), pytest.mark.usefixtures("cleanup_keys")]


def _caller(loop: asyncio.AbstractEventLoop, n: int, prefix: list[int] | None) -> _Caller:
    seqs = [protocol.SeqSpec(tokens=array("i", [1, 2, 3]), prompt_len=1)] * n
    head = None if prefix is None else array("i", prefix)
    return _Caller(seqs, loop.create_future(), 0.0, head)


def test_jobs_of_puts_a_prefix_with_two_sequences_in_a_job_of_its_own() -> None:
    loop = asyncio.new_event_loop()
    try:
        a1, a2, b, none, c2 = (
            _caller(loop, 1, [7, 8]),
            _caller(loop, 1, [7, 8]),
            _caller(loop, 1, [9]),
            _caller(loop, 1, None),
            _caller(loop, 2, [5]),
        )
    finally:
        loop.close()
    jobs = jobs_of([a1, b, none, a2, c2])
    assert [(None if h is None else list(h), part) for h, part in jobs] == [
        ([7, 8], [a1, a2]),  # two callers of one prefix
        ([5], [c2]),  # one caller with two sequences
        (None, [b, none]),  # the only caller of its prefix goes plain, as does no prefix
    ]
    assert jobs_of([b]) == [(None, [b])]
    # a prefix job keeps len(prefix) * (sequences - 1) ids off the wire, at least min_saved_ids
    assert [h is None for h, _ in jobs_of([a1, a2, c2], min_saved_ids=2)] == [False, True]
    assert jobs_of([a1, a2, c2], min_saved_ids=3) == [(None, [a1, a2, c2])]


def test_prefix_callers_share_one_job_per_prompt_and_get_their_whole_sequences_scores(
    redis_url: str, key_prefix: str
) -> None:
    prompts = {"p": [40, 41, 42, 43], "q": [50, 51]}
    calls: list[tuple[list[int] | None, list[int]]] = [
        (prompts["p"], [1, 2]),
        (prompts["q"], [3]),
        (None, [60, 61, 62]),
        (prompts["p"], [4, 5, 6]),
        (prompts["q"], [7, 8]),
        ([70, 71], [9]),  # alone with its prompt: plain
        (prompts["p"], [10]),
    ]
    streams = keys.job_streams(key_prefix)

    async def main() -> list[list[SeqScore]]:
        async with AsyncScoringClient(redis_url, queue=key_prefix) as client:
            batcher = Coalescer(client, window_s=0.05, min_saved_ids=1)
            key = BatchKey(mode="both")
            try:
                return list(
                    await asyncio.gather(
                        *(
                            batcher.score([{"tokens": tail}], key, 10, prefix=head)
                            if head is not None
                            else batcher.score([{"tokens": tail, "prompt_len": 1}], key, 10)
                            for head, tail in calls
                        )
                    )
                )
            finally:
                await batcher.close()

    with Responder(redis_url, streams) as worker, JobTap(redis_url, streams) as tap:
        got = asyncio.run(main())
        bodies = tap.bodies()
    # on the wire: one job per shared prompt, carrying it once, each sequence its tail
    by_prefix: dict[bytes | None, dict[str, Any]] = {b.get("prefix"): b for b in bodies}
    assert len(bodies) == len(by_prefix) == 3
    for name, tails in (("p", [[1, 2], [4, 5, 6], [10]]), ("q", [[3], [7, 8]])):
        body = by_prefix[le_bytes(array("i", prompts[name]))]
        assert [s["tokens"] for s in body["seqs"]] == [le_bytes(array("i", t)) for t in tails]
        assert {s["prompt_len"] for s in body["seqs"]} == {len(prompts[name])}
    plain = by_prefix[None]
    assert [s["tokens"] for s in plain["seqs"]] == [
        le_bytes(array("i", t)) for t in ([60, 61, 62], [70, 71, 9])
    ]
    # decoded, the worker holds the whole sequences
    seen = sorted(tuple(s.tokens) for job in worker.seen_jobs for s in job.seqs)
    assert seen == sorted(tuple((h or []) + t) for h, t in calls)
    for (head, tail), scores in zip(calls, got, strict=True):
        whole = (head or []) + tail
        start = len(head) if head is not None else 1  # prompt_len: len(prefix) by default
        assert list(scores[0].logps) == pytest.approx(expected_logps(whole, start))
        assert scores[0].reward == len(whole)


def test_a_caller_with_a_prefix_may_pass_whole_seq_specs(redis_url: str, key_prefix: str) -> None:
    """``normalize_seqs`` output (whole ``SeqSpec``s) goes with the prefix as it is."""
    from worker.client.inputs import normalize_seqs

    whole = normalize_seqs([[4, 5]], prefix=[1, 2, 3])
    assert list(whole[0].tokens) == [1, 2, 3, 4, 5] and whole[0].prompt_len == 3
    assert normalize_seqs(whole, prefix=[1, 2, 3]) == whole

    async def main() -> list[SeqScore]:
        async with AsyncScoringClient(redis_url, queue=key_prefix) as client:
            return await client.score(whole * 2, prefix=[1, 2, 3], timeout=10)

    streams = keys.job_streams(key_prefix)
    with Responder(redis_url, streams), JobTap(redis_url, streams) as tap:
        got = asyncio.run(main())
        (body,) = tap.bodies()
    assert body["prefix"] == le_bytes(array("i", [1, 2, 3]))
    assert [s["tokens"] for s in body["seqs"]] == [le_bytes(array("i", [4, 5]))] * 2
    assert [list(s.logps) for s in got] == [pytest.approx(expected_logps([1, 2, 3, 4, 5], 3))] * 2


def test_a_failed_group_job_is_split_and_each_caller_keeps_its_prefix(
    redis_url: str, key_prefix: str
) -> None:
    """A prompt's job answered ``bad_request`` (one caller's sequence is refused) goes again one
    caller per job, each with its whole sequences: the good caller gets its scores, the bad one
    its error, and no caller waits for the other."""
    from worker.client.errors import BadRequestError

    prompt = [40, 41, 42, 43]
    streams = keys.job_streams(key_prefix)

    async def main() -> tuple[Any, Any, int]:
        async with AsyncScoringClient(redis_url, queue=key_prefix) as client:
            batcher = Coalescer(client, window_s=0.05, min_saved_ids=1)
            key = BatchKey(mode="both")
            try:
                good, bad = await asyncio.gather(
                    batcher.score([{"tokens": [1, 2]}], key, 10, prefix=prompt),
                    batcher.score([{"tokens": [999, 3]}], key, 10, prefix=prompt),
                    return_exceptions=True,
                )
            finally:
                await batcher.close()
            return good, bad, batcher.splits

    with Responder(redis_url, streams, poison=999) as worker, JobTap(redis_url, streams) as tap:
        good, bad, splits = asyncio.run(main())
        bodies = tap.bodies()
    assert splits == 1
    assert isinstance(bad, BadRequestError) and "999" in str(bad)
    assert list(good[0].logps) == pytest.approx(expected_logps([*prompt, 1, 2], len(prompt)))
    assert bodies[0]["prefix"] == le_bytes(array("i", prompt))  # the group, the prompt once
    assert len(bodies) == 3 and all("prefix" not in b for b in bodies[1:])  # then one each
    assert sorted(tuple(s.tokens) for job in worker.seen_jobs[1:] for s in job.seqs) == [
        (*prompt, 1, 2), (*prompt, 999, 3)]  # fmt: skip
