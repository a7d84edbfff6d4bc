"""Nothing is lost when a worker dies mid-job: a request the gateway coalesced into a job that a
worker holds when it is ``kill -9``-ed is answered once another worker takes the job over (the
consumer group's reclaim), well inside the request's deadline."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import redis
import requests

from tests.support.daemon import WorkerProc, wait_until
from tests.support.gateway import GatewayThread
from worker import keys

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(120)]


def test_a_request_survives_its_worker_being_killed(
    redis_url: str, key_prefix: str, cleanup_keys: None, tmp_path: Path
) -> None:
    stream = keys.job_streams(key_prefix)[0]
    common = ["--redis-url", redis_url, "--queue", key_prefix, "--scorer", "noop",
              "--metrics-port", "0", "--claim-idle-ms", "1500"]  # fmt: skip
    slow = WorkerProc(
        [*common, "--consumer", "slow", "--noop-delay-ms", "20000"], tmp_path / "slow.log"
    ).wait_ready(60)
    r = redis.Redis.from_url(redis_url)
    answers: list[requests.Response] = []
    spare = None
    try:
        with GatewayThread(redis_url, key_prefix, timeout_s=60) as g:
            body = {"query": ["survivor"], "prompts": [""], "labels": [None]}
            caller = threading.Thread(
                target=lambda: answers.append(
                    requests.post(g.url + "/get_reward", json=body, timeout=90)
                )
            )
            caller.start()
            wait_until(
                lambda: r.xpending(stream, keys.DEFAULT_GROUP)["pending"] == 1,
                30,
                what="the slow worker to hold the job",
            )
            slow.signal(signal.SIGKILL)
            slow.wait_exit(10)
            started = time.monotonic()
            spare = WorkerProc([*common, "--consumer", "spare"], tmp_path / "spare.log")
            caller.join(60)
        assert answers and answers[0].status_code == 200, answers and answers[0].text
        assert answers[0].json()["rewards"] == [pytest.approx((sum(b"survivor") % 1000) / 1000)]
        assert time.monotonic() - started < 45
    finally:
        slow.stop()
        if spare is not None:
            spare.stop()
