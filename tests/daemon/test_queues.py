"""One worker, several weighted queues (``serve --queue a:3 --queue b:1``): both served, each
job's result on its own reply stream and its ack on its own queue's group, batches shared by
weight while both are backlogged (counted in scorer calls, not timed), an idle queue's share to
the other, reclaim and dead letters per queue, a heartbeat on every queue (the producers'
``WorkerCheck`` sees the worker on each), ``info`` per queue, and bad ``--queue`` values
refused with exit 2. Real Redis throughout; the worker runs in-process unless the CLI is the
point."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry

from tests.support.daemon import WorkerProc, collect, enqueue, pending_of, wait_until
from worker import keys, streams
from worker.cli import build_parser, main
from worker.client import ScoringClient
from worker.config import RedisSettings
from worker.daemon import Worker
from worker.daemon.backlog import Backlog
from worker.daemon.config import QueueShare, WorkerConfig, queue_shares
from worker.daemon.context import Pending
from worker.observability.metrics import WorkerMetrics
from worker.protocol import decode_job, encode_job
from worker.scorer import Prepared, ScoreRequest, SequenceInput
from worker.scorer.noop import NoopScorer

pytestmark = pytest.mark.redis
GROUP = keys.DEFAULT_GROUP
SEQ_A = [{"tokens": [5, 2, 3, 4], "prompt_len": 1}]  # first token 5: a job of queue a
SEQ_B = [{"tokens": [6, 2, 3, 4], "prompt_len": 1}]  # 6: queue b


class Recorder(NoopScorer):
    """Noop scores; records the first token of every sequence of every call (its queue)."""

    def __init__(self, delay_ms: float = 0.0) -> None:
        super().__init__(vocab_size=100, delay_ms=delay_ms)
        self.calls: list[list[int]] = []

    def score(self, seqs: Any, *, mode: str, temperature: float = 1.0, **options: Any) -> Any:
        self.calls.append([int(s.tokens[0]) for s in seqs])
        return super().score(seqs, mode=mode, temperature=temperature, **options)


def _config(shares: tuple[QueueShare, ...], **kw: Any) -> WorkerConfig:
    kw.setdefault("block_ms", 100)
    kw.setdefault("claim_idle_ms", 5000)
    return WorkerConfig(
        streams=tuple(s for q in shares for s in q.streams),
        queues=shares,
        consumer="mq",
        metrics_port=None,
        **kw,
    )


def _worker(url: str, config: WorkerConfig, scorer: Any) -> Worker:
    return Worker(
        config, RedisSettings(url=url), scorer, metrics=WorkerMetrics(CollectorRegistry())
    )


def _sample(worker: Worker, name: str, **labels: str) -> float | None:
    return worker.metrics.registry.get_sample_value(name, labels)


@pytest.mark.timeout(60)
def test_two_queues_are_served_each_result_to_its_reply_stream_each_ack_on_its_group(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    client = redis.Redis.from_url(redis_url)
    shares = queue_shares([(f"{key_prefix}a", 1), (f"{key_prefix}b", 1)], partitions=2)
    replies = {q.name: keys.reply_stream(q.streams[0], "c") for q in shares}
    ids: dict[str, list[str]] = {q.name: [] for q in shares}
    for q, seq in zip(shares, (SEQ_A, SEQ_B), strict=True):
        for i in range(10):
            job_id = f"{q.name}-{i}"
            enqueue(client, q.streams[i % 2], job_id, replies[q.name], seq)
            ids[q.name].append(job_id)
    worker = _worker(redis_url, _config(shares, max_jobs=20), Recorder())
    assert worker.run() == 0
    for q, first in zip(shares, (5, 6), strict=True):
        results, dups = collect(client, replies[q.name], ids[q.name], timeout=5)
        assert dups == 0 and all(r.ok for r in results.values())
        assert set(results) == set(ids[q.name])  # nothing of the other queue came here
        assert all(
            r.seqs[0].logps is not None and len(r.seqs[0].logps) == 3 for r in results.values()
        )
        for s in q.streams:
            assert pending_of(client, s, GROUP) == 0
        assert _sample(worker, "scoring_queue_jobs_total", queue=q.name, outcome="ok") == 10
        assert _sample(worker, "scoring_queue_batch_jobs_total", queue=q.name) == 10
        assert _sample(worker, "scoring_queue_weight", queue=q.name) == 1
        assert first in {t for call in worker.scorer.calls for t in call}  # type: ignore[attr-defined]
    assert _sample(worker, "scoring_jobs_total", outcome="ok") == 20  # the fleet-wide name stays


@pytest.mark.timeout(60)
def test_weights_share_the_batches_while_both_are_backlogged_then_the_idle_share_goes_over(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    client = redis.Redis.from_url(redis_url)
    shares = queue_shares([(f"{key_prefix}a", 3), (f"{key_prefix}b", 1)])
    reply = keys.reply_stream(shares[0].streams[0], "c")
    for i in range(48):  # a backlog on both before the worker starts
        enqueue(client, shares[0].streams[0], f"a{i}", reply, SEQ_A)
        enqueue(client, shares[1].streams[0], f"b{i}", reply, SEQ_B)
    scorer = Recorder()
    # 8 jobs of 4 tokens per batch: weights 3:1 give 6 of a and 2 of b
    worker = _worker(redis_url, _config(shares, max_jobs=96, max_batch_tokens=32), scorer)
    assert worker.run() == 0
    collect(client, reply, [f"{q}{i}" for q in "ab" for i in range(48)], timeout=5)
    mix = [(call.count(5), call.count(6)) for call in scorer.calls]
    assert mix[:8] == [(6, 2)] * 8, mix  # a (weight 3) empties after 8 batches
    assert mix[8:] == [(0, 8)] * 4, mix  # then b gets whole batches: a's share goes to it
    tokens = {
        q.name: _sample(worker, "scoring_queue_batch_tokens_total", queue=q.name) for q in shares
    }
    assert tokens == {shares[0].name: 48 * 4, shares[1].name: 48 * 4}


def _pending(stream: str, job_id: str, tokens: list[int]) -> Pending:
    job = decode_job(encode_job(job_id, "reference", "r", [{"tokens": tokens, "prompt_len": 1}]))
    prepared = Prepared(ScoreRequest([SequenceInput(tokens, prompt_len=1)]), "reference", 1.0)
    return Pending(
        entry=streams.Entry(stream, f"{len(job_id)}-0", b""),
        job=job,
        prepared=prepared,
        read_at_s=0.0,
    )


def test_a_job_counts_for_what_its_scorer_computes() -> None:
    """A GRPO job whose scorer shares its prompt (``Prepared.cost``) takes its unique tokens
    of the budget: two such jobs of 400 tokens each (cost 120) share a batch of 300."""
    (a,) = queue_shares([("a", 1)])
    backlog = Backlog(max_batch_tokens=300, isolate_after_deliveries=2, shares=(a,))
    for i in range(2):
        p = _pending(a.streams[0], f"g{i}", [5] * 400)
        backlog.append(replace(p, prepared=replace(p.prepared, cost=120)))
    assert [p.tokens for p in backlog.lanes[0].items] == [120, 120]
    assert len(backlog.take_batch()) == 2
    for i in range(2):  # no cost: every token counts, one job per batch
        backlog.append(_pending(a.streams[0], f"w{i}", [5] * 200))
    assert len(backlog.take_batch()) == 1


def test_a_queue_back_from_idle_gets_its_share_and_no_credit_for_the_idle_time() -> None:
    a, b = queue_shares([("a", 3), ("b", 1)])
    backlog = Backlog(max_batch_tokens=32, isolate_after_deliveries=2, shares=(a, b))
    for i in range(80):
        backlog.append(_pending(b.streams[0], f"b{i}", [6, 2, 3, 4]))
    for _ in range(5):  # a is idle: b (weight 1) takes every batch whole
        assert [p.job.id[0] for p in backlog.take_batch()] == ["b"] * 8
    for i in range(40):
        backlog.append(_pending(a.streams[0], f"a{i}", [5, 2, 3, 4]))
    assert backlog.head() is not None and backlog.head().job.id.startswith("a")
    for _ in range(4):  # back from idle: 3:1 at once, not a run of a-only batches
        ids = [p.job.id[0] for p in backlog.take_batch()]
        assert (ids.count("a"), ids.count("b")) == (6, 2)
    assert backlog.counts() == {"a": (16, 64), "b": (32, 128)}
    # reads ahead are sized per queue: a full lane reads nothing, the other up to its budget
    assert backlog.rooms(64, ahead=True) == {"a": 0, "b": 0}
    backlog.lanes[1].items.clear()
    assert backlog.rooms(64, ahead=True) == {"a": 0, "b": 8}
    assert backlog.rooms(64, ahead=True, queued=True) == {"a": 0, "b": 0}


def test_a_worker_reads_about_one_batch_not_a_fixed_count_once_it_knows_the_job_size() -> None:
    """Once a job was seen, a read (idle or not) asks for what completes the token budget by the
    mean job size, so a burst spreads over the fleet instead of one worker holding 64 jobs."""
    (a,) = queue_shares([("a", 1)])
    backlog = Backlog(max_batch_tokens=100, isolate_after_deliveries=2, shares=(a,))
    assert backlog.rooms(64, ahead=False) == {"a": 64}  # no job seen yet: the read count
    backlog.append(_pending(a.streams[0], "j0", [5] * 30))  # 30 tokens held, mean 30
    assert backlog.rooms(64, ahead=False) == {"a": 3}  # ceil(70 / 30): one job past the budget
    assert backlog.rooms(2, ahead=False) == {"a": 2}  # never above the read count
    # while a batch computes: what fills the budget (floor(70 / 30)), not one job past it
    assert backlog.rooms(64, ahead=True) == {"a": 2}
    backlog.append(_pending(a.streams[0], "j1", [5] * 60))  # 90 held: no job fits, read one
    assert backlog.rooms(64, ahead=True) == {"a": 1}
    backlog.append(_pending(a.streams[0], "j2", [5] * 10))  # the budget is held: read nothing
    assert backlog.rooms(64, ahead=True) == {"a": 0}
    assert backlog.rooms(64, ahead=False) == {"a": 64}  # one queue, full: as many as it may
    backlog.take_batch()
    backlog.take_batch()
    assert backlog.rooms(64, ahead=False) == {"a": 4}  # idle again: ceil(100 / 30)


@pytest.mark.timeout(30)
def test_each_queue_is_read_with_its_own_room(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    from worker.daemon.leases import InFlight
    from worker.daemon.reader import EntryReader

    client = redis.Redis.from_url(redis_url)
    shares = queue_shares([(f"{key_prefix}a", 1), (f"{key_prefix}b", 1)], partitions=2)
    for q in shares:
        for s in q.streams:
            streams.ensure_group(client, s, GROUP)
            for i in range(20):
                enqueue(client, s, f"{s}-{i}", "r", SEQ_A)
    in_flight = InFlight()
    reader = EntryReader(_config(shares), in_flight, WorkerMetrics(CollectorRegistry()))

    def per_stream(entries: list[streams.Entry]) -> dict[str, int]:
        return {s: sum(e.stream == s for e in entries) for q in shares for s in q.streams}

    a, b = shares
    # a queue's room is split over its two partitions (rounded up): about room entries in all
    got = per_stream(reader.read(client, {a.name: 3, b.name: 10}, 0))  # a full lane reads little
    assert got == {a.streams[0]: 2, a.streams[1]: 2, b.streams[0]: 5, b.streams[1]: 5}
    got = per_stream(reader.read(client, {a.name: 0, b.name: 4}, 0))  # none from a queue at 0
    assert got == {a.streams[0]: 0, a.streams[1]: 0, b.streams[0]: 2, b.streams[1]: 2}
    got = per_stream(reader.read(client, {a.name: 6, b.name: 6}, 0))  # equal rooms: one read
    assert got == {s: 3 for q in shares for s in q.streams}
    assert len(in_flight) == 4 + 10 + 4 + 12  # every entry read is held (leases renew it)


@pytest.mark.timeout(60)
def test_reclaim_and_dead_letters_stay_on_each_queue(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    client = redis.Redis.from_url(redis_url)
    shares = queue_shares([(f"{key_prefix}a", 2), (f"{key_prefix}b", 1)])
    (sa,), (sb,) = shares[0].streams, shares[1].streams
    ra, rb = keys.reply_stream(sa, "c"), keys.reply_stream(sb, "c")
    for i in range(3):
        enqueue(client, sb, f"b{i}", rb, SEQ_B)
    streams.ensure_group(client, sb, GROUP)
    assert len(client.xreadgroup(GROUP, "ghost", {sb: ">"}, count=10)[0][1]) == 3  # a dead worker
    client.xadd(sb, {"junk": b"1"})  # no payload: dead-lettered on b's own dead stream
    for i in range(2):
        enqueue(client, sa, f"a{i}", ra, SEQ_A)
    time.sleep(0.3)  # the ghost's entries are idle past claim_idle_ms
    config = _config(shares, max_jobs=6, claim_idle_ms=200, reclaim_interval_ms=100)
    worker = _worker(redis_url, config, Recorder())
    assert worker.run() == 0
    res_b, _ = collect(client, rb, ["b0", "b1", "b2"], timeout=5)
    res_a, _ = collect(client, ra, ["a0", "a1"], timeout=5)
    assert all(r.ok for r in [*res_a.values(), *res_b.values()])
    assert client.xlen(keys.dead_letter_stream(sb)) == 1
    assert client.xlen(keys.dead_letter_stream(sa)) == 0
    assert pending_of(client, sa, GROUP) == 0 and pending_of(client, sb, GROUP) == 0
    assert _sample(worker, "scoring_entries_reclaimed_total") == 3
    assert (
        _sample(worker, "scoring_queue_jobs_total", queue=shares[1].name, outcome="dead_letter")
        == 1
    )


@pytest.mark.timeout(60)
def test_producers_of_each_queue_see_the_worker_live_and_get_results_and_info_shows_both(
    redis_url: str, key_prefix: str, cleanup_keys: None, capsys: pytest.CaptureFixture[str]
) -> None:
    qa, qb = f"{key_prefix}train", f"{key_prefix}eval"
    shares = queue_shares([(qa, 3), (qb, 1)])
    worker = _worker(redis_url, _config(shares, stats_interval_s=0.2), Recorder())
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        for queue in (qa, qb):
            with ScoringClient(redis_url, queue=queue) as producer:  # unchanged producers
                wait_until(
                    lambda p=producer: p.live_workers(refresh=True) == 1,
                    20,  # type: ignore[misc]
                    what=f"a live worker on {queue}",
                )
                scores = producer.score([([1, 2, 3, 4], 1)], timeout=20)
                assert len(scores[0].logps) == 3
        capsys.readouterr()
        assert main(["info", "--redis-url", redis_url, "--queue", qa, "--queue", qb, "--json"]) == 0
        infos = json.loads(capsys.readouterr().out)
        assert [i["queue"] for i in infos] == [qa, qb]
        beats = {i["queue"]: i["workers"][0] for i in infos}
        assert beats[qa]["weight"] == "3" and beats[qb]["weight"] == "1"
        assert beats[qa]["queues"] == f"{qa}:3,{qb}:1"
        assert main(["info", "--redis-url", redis_url, "--queue", qa]) == 0
        assert "weight 3 of" in capsys.readouterr().out
        for queue in (qa, qb):  # the stats sample sums each queue's partitions
            wait_until(
                lambda q=queue: _sample(worker, "scoring_queue_lag", queue=q, group=GROUP) == 0,
                10,
                what=f"scoring_queue_lag of {queue}",
            )  # type: ignore[misc]
    finally:
        worker.request_stop("test")
        thread.join(30)
    assert not thread.is_alive()


@pytest.mark.parametrize(
    ("flags", "env", "says"),
    [
        (["--queue", "a:0"], None, "positive integer"),
        (["--queue", "a:x"], None, "positive integer"),
        (["--queue", "a:-2"], None, "positive integer"),
        (["--queue", "a:1.5"], None, "positive integer"),
        (["--queue", "a", "--queue", "a:2"], None, "more than once"),
        (["--queue", "no spaces"], None, "queue name must match"),
        ([], "a:3,a", "more than once"),
        ([], "a:3,b:zero", "positive integer"),
    ],
)
def test_bad_queue_values_are_refused_with_exit_2(
    flags: list[str],
    env: str | None,
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if env is not None:
        monkeypatch.setenv("SCORING_QUEUE", env)
    argv = ["serve", "--scorer", "noop", "--metrics-port", "-1", "--redis-url",
            "redis://127.0.0.1:1/0", *flags]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "--queue" in err, err


def test_the_queue_flags_reach_supervised_children_and_one_queue_is_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker.commands.serve import flag_defaults, worker_config
    from worker.processes.fleet import child_flags, fleet_dests

    monkeypatch.delenv("SCORING_QUEUE", raising=False)
    parser = build_parser("serve")
    args = parser.parse_args(["serve", "--queue", "train:3", "--queue", "eval", "--scorer", "noop"])
    flags = child_flags(args, flag_defaults(), fleet_dests())
    assert [f for f in flags if f.startswith("--queue")] == ["--queue=train:3", "--queue=eval"]
    again = parser.parse_args(["serve", *flags])
    assert again.queue == ["train:3", "eval"]
    config = worker_config(again)
    assert [(q.name, q.weight) for q in config.shares] == [("train", 3), ("eval", 1)]
    assert config.streams == ("scoring:{train}:jobs", "scoring:{eval}:jobs")
    monkeypatch.setenv("SCORING_QUEUE", "train:3,eval:1")
    env_args = build_parser("serve").parse_args(["serve", "--scorer", "noop"])
    assert [(q.name, q.weight) for q in worker_config(env_args).shares] == [
        ("train", 3),
        ("eval", 1),
    ]
    monkeypatch.delenv("SCORING_QUEUE")
    one = worker_config(parser.parse_args(["serve", "--queue", "q", "--partitions", "2"]))
    assert one.streams == tuple(keys.job_streams("q", 2))
    assert [(q.name, q.weight, q.streams) for q in one.shares] == [("q", 1, one.streams)]
    assert child_flags(parser.parse_args(["serve"]), flag_defaults(), fleet_dests()) == []


@pytest.mark.timeout(90)
def test_serve_subprocess_drains_two_weighted_queues(
    redis_url: str, key_prefix: str, cleanup_keys: None, tmp_path: Any
) -> None:
    client = redis.Redis.from_url(redis_url)
    qa, qb = f"{key_prefix}a", f"{key_prefix}b"
    sa, sb = keys.job_streams(qa)[0], keys.job_streams(qb)[0]
    ra, rb = keys.reply_stream(sa, "c"), keys.reply_stream(sb, "c")
    for i in range(5):
        enqueue(client, sa, f"a{i}", ra, SEQ_A)
        enqueue(client, sb, f"b{i}", rb, SEQ_B)
    proc = WorkerProc(["--redis-url", redis_url, "--queue", f"{qa}:3", "--queue", qb,
                       "--scorer", "noop", "--metrics-port", "-1", "--burst"],
                      tmp_path / "worker.log")  # fmt: skip
    try:
        assert proc.wait_exit(60) == 0, proc.log()
    finally:
        proc.stop()
    assert all(
        r.ok for r in collect(client, ra, [f"a{i}" for i in range(5)], timeout=5)[0].values()
    )
    assert all(
        r.ok for r in collect(client, rb, [f"b{i}" for i in range(5)], timeout=5)[0].values()
    )
    assert f"serving {sa},{sb} (group" in proc.log()
    assert pending_of(client, sa, GROUP) == 0 and pending_of(client, sb, GROUP) == 0


@pytest.mark.timeout(120)
def test_the_fairness_bench_runs_its_three_set_ups(
    redis_url: str,
    key_prefix: str,
    cleanup_keys: None,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Any,
) -> None:
    """A smoke run of ``bench --suite fairness`` (tiny sizes; the figures are not asserted)."""
    out = tmp_path / "fairness.json"
    argv = ["bench", "--suite", "fairness", "--", "--redis-url", redis_url, "--prefix",
            key_prefix, "--burst", "300", "--calibrate", "200", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    for row in ("one queue", "two queues 1:1", "two queues 3:1"):
        assert row in text
    report = json.loads(out.read_text())
    assert [r["burst_jobs"] for r in report["results"]] == [300] * 3
    assert all(r["errors"] == 0 and r["steady_jobs"] > 0 for r in report["results"])
