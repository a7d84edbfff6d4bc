"""A worker whose scorer ends the process (like a segfault or a fatal CUDA error) when a batch
holds token 13:
``python tests/support/crash_worker.py URL STREAM CONSUMER CLAIM_IDLE_MS MAX_DELIVERIES``.

Used by ``tests/daemon/test_atleastonce.py`` to show that a job that crashes the worker cannot take
its batch-mates with it to the dead-letter stream."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from prometheus_client import CollectorRegistry

from worker.config import RedisSettings
from worker.daemon import Worker
from worker.daemon.config import WorkerConfig
from worker.observability.metrics import WorkerMetrics
from worker.scorer.noop import NoopScorer

CRASH_TOKEN = 13


class CrashingScorer(NoopScorer):
    """The noop scorer, except that a batch holding ``CRASH_TOKEN`` kills the process."""

    def score(self, seqs: Any, *, mode: str, temperature: float = 1.0, **options: Any) -> Any:
        if any(CRASH_TOKEN in list(s.tokens) for s in seqs):
            print(f"crashing on a batch of {len(seqs)} sequences", flush=True)
            os._exit(3)
        return super().score(seqs, mode=mode, temperature=temperature, **options)


def main() -> int:
    url, stream, consumer, claim_idle_ms, max_deliveries = sys.argv[1:6]
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    config = WorkerConfig(
        streams=(stream,),
        consumer=consumer,
        metrics_port=None,
        block_ms=100,
        claim_idle_ms=int(claim_idle_ms),
        max_deliveries=int(max_deliveries),
        max_wait_ms=50,
    )
    worker = Worker(
        config, RedisSettings(url=url), CrashingScorer(), metrics=WorkerMetrics(CollectorRegistry())
    )
    worker.install_signal_handlers()
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())
