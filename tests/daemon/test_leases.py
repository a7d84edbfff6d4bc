"""The lease keeper warns only about entries it still holds but no longer owns."""

from __future__ import annotations

import logging

import pytest
import redis

from worker import keys, streams
from worker.daemon.leases import InFlight, LeaseKeeper
from worker.observability.health import HealthState
from worker.observability.metrics import WorkerMetrics

G = "g"


def _keeper(url: str, in_flight: InFlight, metrics: WorkerMetrics) -> LeaseKeeper:
    return LeaseKeeper(lambda: redis.Redis.from_url(url), in_flight, group=G, consumer="me",
                       interval_s=1.0, metrics=metrics, health=HealthState())  # fmt: skip


def test_renews_own_entries_and_warns_about_stolen_ones(
    redis_url: str, key_prefix: str, cleanup_keys: None, caplog: pytest.LogCaptureFixture
) -> None:
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    streams.ensure_group(client, stream, G)
    for _ in range(2):
        client.xadd(stream, {"payload": b"j"})
    a, b = streams.read_new(client, [stream], G, "me", count=10, block_ms=None)
    client.xclaim(stream, G, "thief", 0, [b.id], justid=True)
    held, metrics = InFlight(), WorkerMetrics()
    held.add(stream, a.id)
    held.add(stream, b.id)
    with caplog.at_level(logging.WARNING, logger="worker.daemon.leases"):
        assert _keeper(redis_url, held, metrics).renew_once() == 1
    assert "1 in-flight entries" in caplog.text
    assert metrics.registry.get_sample_value("scoring_leases_renewed_total") == 1


def test_entries_acked_during_renewal_are_not_reported_lost(
    redis_url: str,
    key_prefix: str,
    cleanup_keys: None,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    streams.ensure_group(client, stream, G)
    client.xadd(stream, {"payload": b"j"})
    (entry,) = streams.read_new(client, [stream], G, "me", count=10, block_ms=None)
    held = InFlight()
    held.add(stream, entry.id)
    renew = streams.renew_leases

    def ack_first(*args, **kwargs):  # type: ignore[no-untyped-def]
        client.xack(stream, G, entry.id)  # the main thread finished the job meanwhile
        held.discard(stream, entry.id)
        return renew(*args, **kwargs)

    monkeypatch.setattr(streams, "renew_leases", ack_first)
    with caplog.at_level(logging.WARNING, logger="worker.daemon.leases"):
        assert _keeper(redis_url, held, WorkerMetrics()).renew_once() == 0
    assert "no longer ours" not in caplog.text
