"""Signals are acted on outside the signal handler, so a SIGTERM that lands while the main
thread holds a non-reentrant lock (a metric's) cannot deadlock the worker."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
from prometheus_client import CollectorRegistry

from worker.config import RedisSettings
from worker.daemon import Worker
from worker.daemon.config import WorkerConfig
from worker.observability.metrics import WorkerMetrics
from worker.scorer.noop import NoopScorer


@pytest.mark.timeout(20)
def test_sigterm_while_main_thread_holds_a_metric_lock_drains() -> None:
    config = WorkerConfig(streams=("scoring:{sig}:jobs",), consumer="sig", metrics_port=None)
    worker = Worker(
        config, RedisSettings(), NoopScorer(), metrics=WorkerMetrics(CollectorRegistry())
    )
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    old_fd = signal.set_wakeup_fd(-1)
    try:
        worker.install_signal_handlers()
        lock = worker.metrics.draining._value._lock  # request_stop() takes it (draining.set)
        with lock:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)  # the Python-level handler runs here, on this thread, lock held
        deadline = time.monotonic() + 5
        while not worker.health.draining and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker.health.draining
        while worker.metrics.registry.get_sample_value("scoring_worker_draining") != 1:
            assert time.monotonic() < deadline  # the watcher took the lock once it was free
            time.sleep(0.02)
        assert worker.metrics.registry.get_sample_value("scoring_worker_ready") == 0
    finally:
        signal.set_wakeup_fd(old_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if worker.drain.timer is not None:  # never run(): its drain deadline must not fire
            worker.drain.timer.cancel()
        if worker.signals.wakeup is not None:
            rsock, wsock = worker.signals.wakeup
            wsock.shutdown(socket.SHUT_WR)  # EOF ends the watcher thread's recv()
            wsock.close()
            rsock.close()


@pytest.mark.timeout(20)
def test_run_cancels_the_drain_deadline(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    """A worker that drained in time must not be killed later by its drain deadline (an
    in-process worker would take its host process down with it)."""
    config = WorkerConfig(
        streams=(f"scoring:{{{key_prefix}}}:jobs",),
        consumer="c",
        metrics_port=None,
        drain_timeout_s=1.0,
    )
    worker = Worker(
        config,
        RedisSettings(url=redis_url),
        NoopScorer(),
        metrics=WorkerMetrics(CollectorRegistry()),
    )
    worker.request_stop("test")
    assert worker.run() == 0
    assert worker.drain.timer is not None and worker.drain.timer.finished.is_set()
    time.sleep(1.5)  # past the deadline: this process is still alive


@pytest.mark.timeout(20)
def test_drain_deadline_outside_run_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop requested on a worker that is not serving (never ran, as when a signal arrives
    for an in-process worker) arms a deadline that must not end the host process."""
    exits: list[int] = []
    monkeypatch.setattr("worker.daemon.drain.os._exit", exits.append)
    config = WorkerConfig(
        streams=("scoring:{idle}:jobs",), consumer="idle", metrics_port=None, drain_timeout_s=0.2
    )
    worker = Worker(
        config, RedisSettings(), NoopScorer(), metrics=WorkerMetrics(CollectorRegistry())
    )
    worker.request_stop("test")
    assert worker.drain.timer is not None
    worker.drain.timer.join(5)
    assert worker.drain.timer.finished.is_set() and exits == []


@pytest.mark.timeout(30)
def test_drain_deadline_ends_a_worker_stuck_in_a_batch(
    redis_url: str, key_prefix: str, cleanup_keys: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While serving, a drain that outlasts its deadline exits the process (status 1)."""
    import threading

    import redis

    from tests.support.daemon import enqueue
    from worker import keys

    exits: list[int] = []
    monkeypatch.setattr("worker.daemon.drain.os._exit", exits.append)
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    enqueue(
        client,
        stream,
        "slow",
        keys.reply_stream(stream, "c"),
        [{"tokens": [1, 2, 3], "prompt_len": 1}],
    )
    config = WorkerConfig(
        streams=(stream,), consumer="stuck", metrics_port=None, max_jobs=1, drain_timeout_s=0.3
    )
    worker = Worker(
        config,
        RedisSettings(url=redis_url),
        NoopScorer(delay_ms=1500),
        metrics=WorkerMetrics(CollectorRegistry()),
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    deadline = time.monotonic() + 10
    while worker.batch_started_s is None:
        assert time.monotonic() < deadline, "the batch never started"
        time.sleep(0.02)
    worker.request_stop("test")
    time.sleep(0.8)  # past the deadline, the batch still running
    assert exits == [1]
    thread.join(10)
    assert not thread.is_alive()
