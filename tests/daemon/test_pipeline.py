"""The pipelined daemon (real Redis, a scorer gated by the test): while one batch computes, the
main thread reads and validates the next one and writes the previous one's results; it reads at
most one batch ahead, nothing next to a suspect running alone, and a drain finishes both the
computing batch and the one prepared ahead. ``pipeline=False`` (``--no-pipeline``) reads nothing
while a batch computes."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry

from tests.support.daemon import collect, enqueue, pending_of, wait_until
from worker import keys
from worker.config import RedisSettings
from worker.daemon import Worker
from worker.daemon.config import WorkerConfig
from worker.daemon.pipeline import BatchPipeline
from worker.observability.metrics import WorkerMetrics
from worker.scorer.noop import NoopScorer

pytestmark = pytest.mark.redis
GROUP = keys.DEFAULT_GROUP
SEQ = [{"tokens": [1, 2, 3], "prompt_len": 1}]  # 3 tokens: one job per batch at budget 3


class GatedScorer(NoopScorer):
    """Noop scores, but each ``score`` call blocks until the test lets one batch through.
    Records the first sequence's token list of each call and the thread it ran on."""

    def __init__(self) -> None:
        super().__init__(vocab_size=100)
        self.gate = threading.Semaphore(0)
        self.calls: list[list[int]] = []
        self.threads: list[str] = []

    def score(self, seqs: Any, *, mode: Any = None, temperature: Any = None, **kw: Any) -> Any:
        self.calls.append([int(t) for t in seqs[0].tokens])
        self.threads.append(threading.current_thread().name)
        assert self.gate.acquire(timeout=20), "the test never released this batch"
        return super().score(seqs, mode=mode, temperature=temperature)


def _worker(redis_url: str, stream: str, scorer: GatedScorer, **cfg: Any) -> Worker:
    cfg.setdefault("max_batch_tokens", 3)
    cfg.setdefault("read_count", 1)
    cfg.setdefault("claim_idle_ms", 5000)
    config = WorkerConfig(
        streams=(stream,),
        consumer="pipe",
        metrics_port=None,
        block_ms=50,
        max_wait_ms=0,
        **cfg,
    )
    return Worker(
        config, RedisSettings(url=redis_url), scorer, metrics=WorkerMetrics(CollectorRegistry())
    )


def _replies(client: redis.Redis, reply: str) -> int:
    return int(client.xlen(reply))


@pytest.mark.timeout(60)
def test_reads_next_and_writes_previous_while_a_batch_computes(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    scorer = GatedScorer()
    worker = _worker(redis_url, stream, scorer, max_jobs=4)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        enqueue(client, stream, "a", reply, SEQ)
        wait_until(lambda: len(scorer.calls) == 1, 10, what="batch a to start")
        for job_id in ("b", "c", "d"):
            enqueue(client, stream, job_id, reply, SEQ)
        # a computes (blocked): b is read and validated ahead (queued behind a), no more than b
        wait_until(lambda: pending_of(client, stream, GROUP, "pipe") == 2, 10, what="b read")
        wait_until(lambda: worker.pipeline.queued, 10, what="b queued behind a")
        assert len(worker.backlog) == 0 and len(scorer.calls) == 1
        threading.Event().wait(0.3)
        assert pending_of(client, stream, GROUP, "pipe") == 2, "read more than one batch ahead"
        scorer.gate.release()  # a finishes
        # b computes (blocked): a's result is written and acked, c is read ahead
        wait_until(lambda: len(scorer.calls) == 2, 10, what="batch b to start")
        wait_until(lambda: _replies(client, reply) == 1, 10, what="a's result during b")
        wait_until(lambda: pending_of(client, stream, GROUP, "pipe") == 2, 10, what="c read")
        assert worker.pipeline.computing and len(scorer.calls) == 2
        pending = client.xpending_range(stream, GROUP, "-", "+", 10, consumername="pipe")
        assert len(pending) == 2  # b (computing) and c (ahead); a is acked
        for _ in range(3):
            scorer.gate.release()
        results, dupes = collect(client, reply, ["a", "b", "c", "d"], timeout=10)
        assert all(r.ok for r in results.values()) and dupes == 0
    finally:
        for _ in range(4):
            scorer.gate.release()
        thread.join(20)
    assert not thread.is_alive()
    assert set(scorer.threads) == {"compute"}  # the forward never ran on the loop's thread
    assert pending_of(client, stream, GROUP) == 0


@pytest.mark.timeout(60)
def test_no_pipeline_reads_nothing_while_a_batch_computes(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    scorer = GatedScorer()
    worker = _worker(redis_url, stream, scorer, max_jobs=2, pipeline=False)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        enqueue(client, stream, "a", reply, SEQ)
        wait_until(lambda: len(scorer.calls) == 1, 10, what="batch a to start")
        enqueue(client, stream, "b", reply, SEQ)
        threading.Event().wait(0.3)
        assert pending_of(client, stream, GROUP, "pipe") == 1  # b waits in the stream
        scorer.gate.release()
        scorer.gate.release()
        results, _ = collect(client, reply, ["a", "b"], timeout=10)
        assert all(r.ok for r in results.values())
    finally:
        scorer.gate.release()
        scorer.gate.release()
        thread.join(20)
    assert not thread.is_alive()
    assert scorer.threads == [thread.name] * 2  # inline, on the loop's own thread


@pytest.mark.timeout(60)
@pytest.mark.parametrize("handback", [True, False], ids=["handback", "no-handback"])
def test_drain_finishes_the_computing_batch_and_hands_back_the_one_ahead(
    redis_url: str, key_prefix: str, cleanup_keys: None, handback: bool
) -> None:
    """The computing batch is finished; the one queued behind it is handed back to the group
    (``handback=False``: finished too)."""
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    scorer = GatedScorer()
    worker = _worker(redis_url, stream, scorer, handback=handback)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        enqueue(client, stream, "a", reply, SEQ)
        wait_until(lambda: len(scorer.calls) == 1, 10, what="batch a to start")
        enqueue(client, stream, "b", reply, SEQ)
        enqueue(client, stream, "c", reply, SEQ)
        wait_until(lambda: worker.pipeline.queued, 10, what="b read ahead")
        worker.request_stop("test")
        if handback:  # a still computes: b is handed back before a finishes
            wait_until(lambda: worker.handback.given == 1, 10, what="b handed back")
        scorer.gate.release()
        scorer.gate.release()
        thread.join(20)
        assert not thread.is_alive()
    finally:
        for _ in range(3):
            scorer.gate.release()
        thread.join(20)
    assert client.xinfo_groups(stream)[0]["lag"] == 1  # c was never read
    if not handback:
        results, _ = collect(client, reply, ["a", "b"], timeout=5)
        assert results["a"].ok and results["b"].ok
        assert pending_of(client, stream, GROUP) == 0  # both acked
        return
    results, _ = collect(client, reply, ["a"], timeout=5)
    assert results["a"].ok and len(scorer.calls) == 1  # b never started
    (row,) = client.xpending_range(stream, GROUP, "-", "+", 10)
    assert row["time_since_delivered"] > 24 * 3600 * 1000  # claimable by anyone at once
    assert row["times_delivered"] == 0  # and its delivery not counted
    assert worker.handback.given == 1


@pytest.mark.timeout(60)
def test_nothing_is_read_ahead_of_a_suspect_running_alone(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    enqueue(client, stream, "sus", reply, SEQ)
    client.xgroup_create(stream, GROUP, id="0")
    ((entry_id, _),) = client.xreadgroup(GROUP, "dead", {stream: ">"}, count=1)[0][1]
    # delivered 3 times to a consumer that died: past isolate_after_deliveries=2, a suspect
    client.xclaim(stream, GROUP, "dead", 0, [entry_id], retrycount=3, idle=60000)
    scorer = GatedScorer()
    worker = _worker(redis_url, stream, scorer, max_jobs=2, claim_idle_ms=1000,
                     max_batch_tokens=100, read_count=8)  # fmt: skip
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: len(scorer.calls) == 1, 10, what="the suspect to start")
        assert worker.pipeline.suspect_running
        enqueue(client, stream, "next", reply, SEQ)
        threading.Event().wait(0.4)
        assert pending_of(client, stream, GROUP, "pipe") == 1  # nothing read next to it
        scorer.gate.release()
        wait_until(lambda: len(scorer.calls) == 2, 10, what="the next job")
        scorer.gate.release()
        results, _ = collect(client, reply, ["sus", "next"], timeout=10)
        assert results["sus"].ok and results["next"].ok
    finally:
        scorer.gate.release()
        scorer.gate.release()
        thread.join(20)
    assert not thread.is_alive()


def test_stage_hands_back_replies_and_errors_once() -> None:
    """Without Redis: one batch computes and one waits queued behind it (a third is refused, and
    so is a suspect behind a batch), replies come back in order, and an error raised by the
    compute step comes out of ``take_done`` in the caller's thread and frees the stage."""
    started = threading.Event()
    release = threading.Event()

    def score(batch: list[Any]) -> list[Any]:
        started.set()
        assert release.wait(10)
        if batch == ["boom"]:
            raise RuntimeError("bug in a step")
        return [f"r{x}" for x in batch]

    stage = BatchPipeline(score)  # type: ignore[arg-type]
    stage.submit([1, 2])  # type: ignore[list-item]
    assert started.wait(5) and stage.computing and stage.take_done() is None
    assert not stage.can_take(suspect=True)
    stage.submit([3])  # type: ignore[list-item]
    assert stage.queued and not stage.can_take()
    with pytest.raises(RuntimeError):
        stage.submit([4])  # type: ignore[list-item]
    release.set()
    wait_until(lambda: not stage.computing, 5, what="both batches")
    assert stage.take_done() == ["r1", "r2", "r3"] and not stage.busy
    stage.submit(["boom"])  # type: ignore[list-item]
    assert stage.wait(5)
    with pytest.raises(RuntimeError, match="bug in a step"):
        stage.take_done()
    assert not stage.busy and stage.take_done() is None
    stage.close()


def test_no_pipeline_flag_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from worker.commands import serve

    def config(argv: list[str]) -> WorkerConfig:
        parser = argparse.ArgumentParser()
        serve.configure(parser)
        return serve.worker_config(parser.parse_args(["--stream", "s", *argv]))

    assert config([]).pipeline is True
    assert config(["--no-pipeline"]).pipeline is False
    monkeypatch.setenv("SCORING_PIPELINE", "0")
    assert config([]).pipeline is False


@pytest.mark.timeout(60)
def test_reads_ahead_one_batch_budget_even_with_a_large_read_count(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    scorer = GatedScorer()
    # 2 jobs of 3 tokens per batch, up to 64 entries per read
    worker = _worker(redis_url, stream, scorer, max_jobs=12, max_batch_tokens=6, read_count=64)
    thread = threading.Thread(target=worker.run)
    thread.start()
    ids = [f"j{i}" for i in range(12)]
    try:
        enqueue(client, stream, ids[0], reply, SEQ)
        wait_until(lambda: len(scorer.calls) == 1, 10, what="the first batch to start")
        for job_id in ids[1:]:
            enqueue(client, stream, job_id, reply, SEQ)
        wait_until(lambda: worker.pipeline.queued, 10, what="a batch read ahead")
        threading.Event().wait(0.3)
        # one batch's budget ahead (queued), not 11 jobs
        assert pending_of(client, stream, GROUP, "pipe") == 3 and not worker.backlog
        for _ in range(12):
            scorer.gate.release()
        results, _ = collect(client, reply, ids, timeout=10)
        assert all(r.ok for r in results.values())
    finally:
        for _ in range(12):
            scorer.gate.release()
        thread.join(20)
    assert not thread.is_alive()
