"""The daemon's roles one by one, without Redis: intake outcomes, job outcomes of a batch, the
backlog's batch taking, the in-flight set, drain control and stream-stats sampling."""

from __future__ import annotations

import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry

from worker.daemon import DeadLetter, JobContext, Pending, Reply
from worker.daemon.backlog import Backlog
from worker.daemon.config import WorkerConfig
from worker.daemon.drain import DrainControl
from worker.daemon.intake import prepare_entry
from worker.daemon.jobs import score_batch
from worker.daemon.leases import InFlight
from worker.daemon.stats import StatsSampler
from worker.observability.health import HealthState
from worker.observability.metrics import WorkerMetrics
from worker.protocol import encode_job
from worker.scorer import FallbackEvent, ScoreOptions
from worker.scorer.noop import NoopScorer
from worker.streams import Entry

SEQ = {"tokens": [1, 2, 3, 4], "prompt_len": 1}


def _ctx(scorer: Any = None, **cfg: Any) -> JobContext:
    config = WorkerConfig(streams=("scoring:{r}:jobs",), consumer="me", metrics_port=None, **cfg)
    return JobContext(
        config, scorer or NoopScorer(vocab_size=100), WorkerMetrics(CollectorRegistry()), InFlight()
    )


def _entry(job_id: str = "j", deliveries: int = 1, payload: bytes | None = b"", **kw: Any) -> Entry:
    if payload == b"":
        payload = encode_job(job_id, kw.pop("mode", "reference"), "r", [SEQ], **kw)
    return Entry("scoring:{r}:jobs", f"{int(time.time() * 1000)}-0", payload, deliveries)


def _pending(ctx: JobContext, job_id: str, deliveries: int = 1, **kw: Any) -> Pending:
    out = prepare_entry(ctx, _entry(job_id, deliveries, **kw))
    assert isinstance(out, Pending), out
    return out


def test_intake_outcomes() -> None:
    ctx = _ctx(max_deliveries=3)
    assert isinstance(prepare_entry(ctx, _entry()), Pending)
    dead = prepare_entry(ctx, _entry(deliveries=4))
    assert isinstance(dead, DeadLetter) and dead.reason.startswith("max_deliveries")
    assert dead.result is not None and dead.result.code == "dead_letter" and dead.reply_to == "r"
    nothing = prepare_entry(ctx, _entry(payload=None))
    assert isinstance(nothing, DeadLetter) and nothing.result is None
    late = prepare_entry(ctx, _entry(deadline_ms=1))
    assert isinstance(late, Reply) and late.result.code == "expired"
    bad = prepare_entry(ctx, _entry(payload=b"\x81\xa1v\x01"))  # no reply_to to answer
    assert isinstance(bad, DeadLetter) and bad.reason.startswith("no_reply_to")
    scorer = NoopScorer(vocab_size=100)
    scorer.modes = ("reward",)
    wrong = prepare_entry(_ctx(scorer), _entry())
    assert isinstance(wrong, Reply) and wrong.result.code == "unsupported_mode"
    assert wrong.result.info["worker"] == "me" and wrong.result.info["model"] == "noop"
    reg = ctx.metrics.registry
    assert reg.get_sample_value("scoring_entries_redelivered_total") == 1


class _Breaks(NoopScorer):
    """Raises on any batch holding token 13."""

    def score(self, seqs: Any, *, mode: Any = None, temperature: Any = 1.0, **options: Any) -> Any:
        if any(13 in list(s.tokens) for s in seqs):
            raise RuntimeError("poisoned")
        return super().score(seqs, mode=mode, temperature=temperature, **options)


def test_score_batch_returns_one_reply_per_job_and_isolates_the_poison() -> None:
    scorer = _Breaks(vocab_size=100)
    scorer.load_fallbacks = [
        FallbackEvent("flash_attention_2", "sdpa", "not_installed", "m", "load"),
        FallbackEvent("packed", "padded", "no_packing", "m", "load"),
    ]
    ctx = _ctx(scorer)
    batch = [_pending(ctx, f"j{i}") for i in range(4)]
    batch.insert(2, prepare_entry(ctx, _entry("bad", payload=encode_job("bad", "reference", "r",
                                  [{"tokens": [1, 13, 3], "prompt_len": 1}]))))  # fmt: skip
    replies = score_batch(ctx, batch)  # type: ignore[arg-type]
    assert [r.result.id for r in replies] == ["j0", "j1", "bad", "j2", "j3"]
    codes = {r.result.id: r.result.code or "ok" for r in replies}
    assert codes.pop("bad") == "internal" and set(codes.values()) == {"ok"}
    info = replies[0].result.info
    assert info["fallback_reason"] == "flash_attention_2->sdpa: not_installed (at load)"
    # [j0 j1 bad j2 j3] fails -> [j0 j1] ok, [bad j2 j3] fails -> [bad] fails, [j2 j3] ok
    assert ctx.metrics.registry.get_sample_value("scoring_batches_total") == 2


def test_backlog_takes_one_key_within_budget_and_suspects_alone() -> None:
    ctx = _ctx(isolate_after_deliveries=2)
    backlog = Backlog(max_batch_tokens=8, isolate_after_deliveries=2)
    for p in (
        _pending(ctx, "a"),
        _pending(ctx, "b", mode="reward"),
        _pending(ctx, "c"),
        _pending(ctx, "d"),
        _pending(ctx, "s", deliveries=3),
    ):
        backlog.append(p)
    assert backlog.tokens() == 20 and backlog.full() and backlog.holds_suspect()
    assert [p.job.id for p in backlog.take_batch()] == ["a", "c"]  # 4 + 4 tokens, same key
    assert [p.job.id for p in backlog.take_batch()] == ["b"]
    assert [p.job.id for p in backlog.take_batch()] == ["d"]
    assert backlog.held_ids() == {("scoring:{r}:jobs", next(iter(backlog)).entry.id)}
    assert [p.job.id for p in backlog.take_batch()] == ["s"]  # the suspect runs alone
    assert not backlog and backlog.take_batch() == []


def test_in_flight_release_all_but() -> None:
    held = InFlight()
    for stream, entry_id in (("a", "1"), ("a", "2"), ("b", "3")):
        held.add(stream, entry_id)
    assert held.release_all_but({("a", "2")}) == 2
    assert held.snapshot() == {"a": ["2"]} and len(held) == 1


def test_drain_control_stop_deadline_and_wait() -> None:
    health, metrics = HealthState(), WorkerMetrics(CollectorRegistry())
    drain = DrainControl(30.0, health=health, metrics=metrics, held=lambda: 3)
    assert not drain.stopping and not drain.deadline_passed()
    waker = threading.Timer(0.05, drain.request_stop, args=("test",))
    waker.start()
    t0 = time.monotonic()
    with drain.serving():
        drain.wait(5.0)  # cut short by the stop request
    assert time.monotonic() - t0 < 2.0
    assert drain.stopping and health.draining
    assert metrics.registry.get_sample_value("scoring_worker_draining") == 1
    assert drain.timer is not None and drain.timer.finished.is_set()  # disarmed on leaving
    assert not drain.deadline_passed()


class _FakeStats:
    """Just what ``stream_stats`` and the sampler read: XLEN, XINFO GROUPS / CONSUMERS."""

    def __init__(self) -> None:
        self.calls = 0

    def xlen(self, key: str) -> int:
        self.calls += 1
        return 2 if key.endswith(":dead") else 10

    def xinfo_groups(self, key: str) -> list[dict[str, Any]]:
        return [{"name": b"scoring", "pending": 3, "consumers": 1, "lag": 7,
                 "last-delivered-id": b"1-0"}]  # fmt: skip

    def xinfo_consumers(self, key: str, group: str) -> list[dict[str, Any]]:
        return [{"name": b"me", "pending": 3, "idle": 5}]

    # the sampler also trims acked entries (XPENDING summary, XTRIM MINID)
    def xpending(self, key: str, group: str) -> dict[str, Any]:
        return {"pending": 3, "min": b"1-0", "max": b"1-0", "consumers": []}

    def xtrim(self, key: str, **kwargs: Any) -> int:
        self.trimmed = kwargs
        return 0


def test_stats_sampler_publishes_gauges_at_most_every_interval() -> None:
    metrics = WorkerMetrics(CollectorRegistry())
    now = [100.0]
    sampler = StatsSampler(
        ("s",),
        "scoring",
        metrics=metrics,
        dead_stream_of=lambda s: s + ":dead",
        interval_s=5.0,
        clock=lambda: now[0],
    )
    client = _FakeStats()
    assert sampler.maybe_sample(client)
    now[0] += 1.0
    assert not sampler.maybe_sample(client)
    now[0] += 5.0
    assert sampler.maybe_sample(client)
    reg = metrics.registry
    assert reg.get_sample_value("scoring_stream_length", {"stream": "s"}) == 10
    assert reg.get_sample_value("scoring_stream_lag", {"stream": "s", "group": "scoring"}) == 7
    assert reg.get_sample_value("scoring_stream_pending", {"stream": "s", "group": "scoring"}) == 3
    assert reg.get_sample_value("scoring_dead_letter_length", {"stream": "s:dead"}) == 2


def test_pending_key_is_mode_temperature_and_options() -> None:
    assert _pending(_ctx(), "k", temperature=0.5, mode="both").key == ("both", 0.5, ScoreOptions())
