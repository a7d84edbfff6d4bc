"""The sans-I/O client core, driven by hand: no Redis, no threads, no event loop.

Each operation of ``worker.client.core`` yields effects; these tests answer them with scripted
replies and check what the core asks for and what it keeps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import redis

from worker import protocol
from worker.client import ClientClosed, ScoringTimeout, TooLongError, UnknownQueueError
from worker.client.core import ClientCore
from worker.client.effects import END, Block, Command, Delivered, Effect, NextItem, Pause, Steps
from worker.client.window import ScoreWindow

pytestmark = pytest.mark.timeout(10)

SEQ = [([1, 2, 3], 1)]


def drive(steps: Steps[Any], answer: Callable[[Effect], Any]) -> Any:
    """Run ``steps`` to completion; ``answer`` returns each effect's reply or raises its error."""
    reply: Any = None
    error: BaseException | None = None
    while True:
        try:
            effect = steps.throw(error) if error is not None else steps.send(reply)
        except StopIteration as stop:
            return stop.value
        reply, error = None, None
        try:
            reply = answer(effect)
        except BaseException as exc:
            error = exc


def entry(result: protocol.Result, entry_id: bytes = b"1-0") -> tuple[bytes, dict[bytes, bytes]]:
    return entry_id, {protocol.PAYLOAD_FIELD: protocol.encode_result(result)}


def ok(job_id: str) -> protocol.Result:
    return protocol.Result(id=job_id, ok=True, seqs=[protocol.SeqResult(reward=1.0)])


def test_submit_asks_for_one_xadd_and_tracks_the_job() -> None:
    core = ClientCore(queue="q", client_id="c", check_workers=False)
    job = core.prepare(SEQ, job_id="j1", meta={"m": 1})
    seen: list[Effect] = []

    def answer(effect: Effect) -> Any:
        seen.append(effect)
        return b"5-0"

    handle = drive(core.submit(job), answer)
    assert handle.job_id == "j1" and handle.entry_id == "5-0" and handle.num_seqs == 1
    (xadd,) = seen
    assert isinstance(xadd, Command) and xadd.name == "xadd" and xadd.args[0] == core.job_streams[0]
    decoded = protocol.decode_job(xadd.args[1][protocol.PAYLOAD_FIELD])
    assert decoded.reply_to == core.reply_stream and decoded.meta == {"m": 1}
    assert core.outstanding.keys() == {"j1"}


def test_a_failed_xadd_untracks_the_job() -> None:
    core = ClientCore(client_id="c", check_workers=False)

    def refuse(effect: Effect) -> Any:
        raise redis.ConnectionError("down")

    with pytest.raises(redis.ConnectionError):
        drive(core.submit(core.prepare(SEQ, job_id="j1")), refuse)
    assert core.outstanding == {}


def test_wait_blocks_until_the_result_is_ingested_and_drops_duplicates() -> None:
    core = ClientCore(client_id="c", check_workers=False)
    core.outstanding["j1"] = 0.0
    blocks: list[Block] = []

    def answer(effect: Effect) -> Any:
        assert isinstance(effect, Block)
        blocks.append(effect)
        assert core.ingest([entry(ok("j1")), entry(ok("j1"), b"2-0")]) == 1
        return None

    result = drive(core.wait_result("j1", None), answer)
    assert result.id == "j1" and result.ok
    assert len(blocks) == 1 and blocks[0].timeout_s is None and core.arrivals == blocks[0].seen + 1
    assert core.buffer.duplicates == 1 and core.outstanding == {}
    assert core.ingest([entry(ok("j1"), b"3-0")]) == 0 and core.buffer.duplicates == 2


def test_a_timed_out_score_forgets_its_job_and_its_late_result_is_dropped() -> None:
    core = ClientCore(client_id="c", check_workers=False)

    def answer(effect: Effect) -> Any:
        if isinstance(effect, Command):
            return b"1-0"
        assert isinstance(effect, Block) and effect.timeout_s is not None
        return None  # nothing arrives; the core sees the deadline pass

    with pytest.raises(ScoringTimeout):
        drive(core.score(core.prepare(SEQ, job_id="j1"), 0.01), answer)
    assert core.outstanding == {} and core.keep_reply_stream()
    core.ingest([entry(ok("j1"))])
    assert core.buffer.late == 1 and core.buffer.ready == {}


def test_error_results_raise_their_job_failed() -> None:
    core = ClientCore(client_id="c", check_workers=False)
    core.ingest([entry(protocol.error_result("j1", "too_long", "seqs[0]: too long"))])

    def answer(effect: Effect) -> Any:
        return b"1-0"

    with pytest.raises(TooLongError, match="too long"):
        drive(core.score(core.prepare(SEQ, job_id="j1"), 1.0), answer)


def test_closing_ends_a_wait() -> None:
    core = ClientCore(client_id="c", check_workers=False)

    def close(effect: Effect) -> Any:
        core.closed = True

    with pytest.raises(ClientClosed, match="job j1"):
        drive(core.wait_result("j1", None), close)


def test_the_reader_backs_off_on_connection_errors_and_reads_after() -> None:
    core = ClientCore(client_id="c", check_workers=False, block_ms=10)
    log: list[Any] = []
    replies: list[Any] = [
        redis.ConnectionError("a"),
        redis.ConnectionError("b"),
        redis.ResponseError("NOPERM"),
        [(core.reply_stream.encode(), [entry(ok("j1"), b"7-0")])],
    ]
    xreads = iter(replies)

    def answer(effect: Effect) -> Any:
        log.append(effect)
        if isinstance(effect, Command) and effect.name == "xread":
            reply = next(xreads)
            if isinstance(reply, Exception):
                raise reply
            return reply
        if isinstance(effect, Command) and effect.name == "xdel":
            core.closed = True  # stop after one round
        return 1

    drive(core.read_replies(), answer)
    pauses = [e.seconds for e in log if isinstance(e, Pause)]
    assert pauses == [0.05, 0.1, 1.0] and core.reconnects == 2
    assert any(isinstance(e, Delivered) for e in log)
    xdel = next(e for e in log if isinstance(e, Command) and e.name == "xdel")
    assert xdel.args == (core.reply_stream, b"7-0")
    assert list(core.buffer.ready) == ["j1"]
    expires = [e for e in log if isinstance(e, Command) and e.name == "expire"]
    assert len(expires) == 1  # the TTL is refreshed a third of it apart, not on every read


def test_the_window_keeps_max_in_flight_and_forgets_what_is_left() -> None:
    core = ClientCore(client_id="c", check_workers=False)
    jobs = [{"seqs": SEQ, "id": f"j{i}"} for i in range(5)]
    window = ScoreWindow(
        core,
        jobs,
        max_in_flight=2,
        ordered=True,
        timeout=None,
        mode=None,
        temperature=1.0,
        raise_errors=True,
    )
    submitted: list[str] = []
    answered: list[str] = []

    def answer(effect: Effect) -> Any:
        if isinstance(effect, NextItem):
            return next(effect.source, END)
        if isinstance(effect, Command):
            submitted.append(protocol.decode_job(effect.args[1][protocol.PAYLOAD_FIELD]).id)
            return b"1-0"
        assert isinstance(effect, Block)
        assert len(core.outstanding) <= 2
        answered.append(submitted[len(answered)])  # the oldest unanswered job is answered
        core.ingest([entry(ok(answered[-1]))])
        return None

    first = drive(window.next(), answer)
    assert first.job_id == "j0" and submitted == ["j0", "j1"]
    second = drive(window.next(), answer)
    assert second.job_id == "j1" and submitted == ["j0", "j1", "j2"]
    window.close()  # the caller stops: j2 is forgotten
    assert core.outstanding == {} and core.buffer.abandoned.keys() == {"j2"}
    with pytest.raises(ValueError, match="max_in_flight"):
        ScoreWindow(
            core,
            [],
            max_in_flight=0,
            ordered=True,
            timeout=None,
            mode=None,
            temperature=1.0,
            raise_errors=True,
        )


def _queue_answers(live: int, groups: list[Any], seen: list[Effect]) -> Callable[[Effect], Any]:
    """Answers for a queue with ``live`` workers and ``groups`` on its stream (``None``: no such
    stream); ``SCAN`` finds two other queues."""

    def answer(effect: Effect) -> Any:
        seen.append(effect)
        name = effect.name  # type: ignore[union-attr]
        if name == "zcount":
            return live
        if name == "xinfo_groups":
            if groups is None:
                raise redis.ResponseError("no such key")
            return groups
        if name == "scan":
            names = [b"scoring:{other}:jobs", b"scoring:{q}:jobs", b"scoring:{w2}:workers"]
            return 0, names if "jobs" in effect.kwargs["match"] else [b"scoring:{w2}:workers"]  # type: ignore[union-attr]
        return b"5-0"

    return answer


def test_a_served_queue_is_asked_once_then_jobs_wait() -> None:
    core = ClientCore(queue="q", client_id="c")
    seen: list[Effect] = []
    answer = _queue_answers(0, [{"name": "scoring"}], seen)  # a group, no live worker
    for job_id in ("j1", "j2"):
        drive(core.submit(core.prepare(SEQ, job_id=job_id)), answer)
    assert [e.name for e in seen] == ["zcount", "xinfo_groups", "xadd", "xadd"]  # type: ignore[union-attr]
    assert seen[0].args[0] == "scoring:{q}:workers"  # type: ignore[union-attr]
    assert seen[1].args[0] == "scoring:{q}:jobs"  # type: ignore[union-attr]
    # a timeout then says no worker served the queue (asked again at the timeout)
    exc = drive(core.timeout("j1", 1.0), answer)
    assert isinstance(exc, ScoringTimeout) and "no worker served queue 'q'" in str(exc)
    assert seen[-1].name == "zcount"  # type: ignore[union-attr]


def test_a_queue_with_a_live_worker_is_not_asked_for_groups() -> None:
    core = ClientCore(queue="q", client_id="c")
    seen: list[Effect] = []
    drive(core.submit(core.prepare(SEQ, job_id="j1")), _queue_answers(2, [], seen))
    assert [e.name for e in seen] == ["zcount", "xadd"]  # type: ignore[union-attr]
    exc = drive(core.timeout("j1", 1.0), _queue_answers(2, [], seen))
    assert "no worker served" not in str(exc)


@pytest.mark.parametrize("groups", [None, []], ids=["no-stream", "no-group"])
def test_an_unknown_queue_is_refused_before_any_xadd(groups: list[Any] | None) -> None:
    core = ClientCore(queue="q", client_id="c", partitions=2)
    seen: list[Effect] = []
    answer = _queue_answers(0, groups, seen)  # type: ignore[arg-type]
    for _ in range(2):  # asked again at each submit while unknown
        with pytest.raises(UnknownQueueError) as info:
            drive(core.submit(core.prepare(SEQ, job_id="j1")), answer)
        assert info.value.code == "unknown_queue" and info.value.queue == "q"
        assert info.value.queues == ["other", "w2"]  # the queues there are, not itself
        assert "'q'" in str(info.value) and "other, w2" in str(info.value)
    names = [e.name for e in seen]  # type: ignore[union-attr]
    assert "xadd" not in names and names.count("zcount") == 2
    assert names.count("xinfo_groups") == 4  # both partitions, twice
    assert core.outstanding == {} and core.resubmitter.due(["j1"], 1e18) == []


def test_wait_for_unknown_queue_submits_anyway_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    core = ClientCore(queue="q", client_id="c", wait_for_unknown_queue=True)
    seen: list[Effect] = []
    with caplog.at_level(logging.WARNING):
        for job_id in ("j1", "j2"):
            drive(core.submit(core.prepare(SEQ, job_id=job_id)), _queue_answers(0, None, seen))
    assert [e.name for e in seen] == ["zcount", "xinfo_groups", "xadd", "xadd"]  # type: ignore[union-attr]
    warned = [r for r in caplog.records if "none ever did" in r.getMessage()]
    assert len(warned) == 1


def test_a_refused_worker_count_is_no_error() -> None:
    core = ClientCore(queue="q", client_id="c")

    def answer(effect: Effect) -> Any:
        if effect.name in ("zcount", "xinfo_groups"):  # type: ignore[union-attr]
            raise redis.ResponseError("NOPERM this user has no permissions to run it")
        return b"5-0"

    assert drive(core.submit(core.prepare(SEQ, job_id="j1")), answer).entry_id == "5-0"
    assert core.workers.live is None
    exc = drive(core.timeout("j1", 1.0), answer)
    assert "is a worker serving this queue?" in str(exc)
