"""Small jobs at a fixed offered rate: jobs/s and p50/p99 latency against ``--max-wait-ms``.

``python -m worker.devtools.bench.small [--quick] [--redis-url URL]`` (also ``scoring-worker
bench --suite small``). Without ``--redis-url`` an embedded Valkey is started.

1,000 one-sequence jobs of ~200 tokens (180-220, prompt a quarter) are ``XADD``-ed at a fixed
offered rate (default 400 jobs/s) to one ``serve`` subprocess running the no-op scorer with a fixed
per-batch delay (``--noop-delay-ms``, default 5 ms: a stand-in for a small model's forward, so
the figures are about the queue and the batching, not a model). A reader thread records when each
result arrives; latency is arrival minus submission. One row per (``--max-wait-ms``, pipelined
or ``--no-pipeline``).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from worker import keys
from worker.demo.embedded import redis_url_or_embedded
from worker.processes.local import LocalWorker
from worker.protocol import decode_result, encode_job


def run_once(
    url: str, n: int, rate: float, max_wait_ms: int, delay_ms: float, pipeline: bool, log: Path
) -> dict[str, float]:
    """One worker, ``n`` jobs at ``rate`` jobs/s; jobs/s and latency percentiles in ms."""
    tag = f"small{os.getpid()}w{max_wait_ms}{'p' if pipeline else 's'}"
    stream = keys.job_streams(tag)[0]
    reply = keys.reply_stream(stream, "bench")
    client: Any = redis.Redis.from_url(url)
    client.delete(stream, reply)
    rng = random.Random(max_wait_ms)
    payloads = []
    for i in range(n):
        length = rng.randint(180, 220)
        seq = {"tokens": [rng.randrange(1, 32000) for _ in range(length)], "prompt_len": 50}
        payloads.append(encode_job(f"j{i}", "reference", reply, [seq]))
    arrived: dict[str, float] = {}

    def read() -> None:
        reader: Any = redis.Redis.from_url(url)
        last = "0-0"
        deadline = time.monotonic() + 120 + n / rate
        while len(arrived) < n and time.monotonic() < deadline:
            for _s, entries in reader.xread({reply: last}, count=1000, block=100) or []:
                now = time.perf_counter()
                for entry_id, fields in entries:
                    last = entry_id.decode()
                    arrived.setdefault(decode_result(fields[b"payload"]).id, now)

    worker = LocalWorker(
        ["--redis-url", url, "--queue", tag, "--scorer", "noop", "--noop-delay-ms", str(delay_ms),
         "--max-wait-ms", str(max_wait_ms), "--consumer", "bench", "--metrics-port", "-1",
         *([] if pipeline else ["--no-pipeline"])],
        log_path=log, append=True, log_level="WARNING",
    )  # fmt: skip
    try:
        client.xadd(stream, {"payload": encode_job("warm", "reference", reply, [seq])})
        while not client.xlen(reply):  # the worker is up and serving
            time.sleep(0.05)
        client.delete(reply)
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        sent: list[float] = []
        start = time.perf_counter()
        for i, p in enumerate(payloads):
            wait = start + i / rate - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            sent.append(time.perf_counter())
            client.xadd(stream, {"payload": p})
        reader.join()
    finally:
        worker.stop(30)
        client.delete(stream, reply, keys.dead_letter_stream(stream))
    if len(arrived) < n:
        raise RuntimeError(f"only {len(arrived)}/{n} results; see {log}")
    lat = sorted((arrived[f"j{i}"] - sent[i]) * 1000.0 for i in range(n))
    return {
        "jobs_per_s": n / (max(arrived.values()) - sent[0]),
        "p50_ms": lat[n // 2],
        "p99_ms": lat[min(n - 1, int(n * 0.99))],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run every ``--max-wait-ms`` value, pipelined and not, and print the table."""
    p = argparse.ArgumentParser(prog="bench_small", description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", default=None, help="default: an embedded Valkey")
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--rate", type=float, default=400.0, help="offered jobs/s")
    p.add_argument("--noop-delay-ms", type=float, default=5.0, help="per-batch delay")
    p.add_argument("--max-wait-ms", type=int, action="append", help="default: 0, 5, 20")
    p.add_argument("--quick", action="store_true", help="200 jobs, --max-wait-ms 5 only")
    args, _ = p.parse_known_args(argv)
    n = min(args.jobs, 200) if args.quick else args.jobs
    waits = args.max_wait_ms or ([5] if args.quick else [0, 5, 20])
    rows: list[tuple[int, str, dict[str, Any]]] = []
    with (
        redis_url_or_embedded(args.redis_url) as url,
        tempfile.TemporaryDirectory(prefix="bench-small-") as tmp,
    ):
        for wait in waits:
            for pipeline in (True, False):
                figs = run_once(url, n, args.rate, wait, args.noop_delay_ms, pipeline,
                                Path(tmp) / "worker.log")  # fmt: skip
                rows.append((wait, "pipelined" if pipeline else "--no-pipeline", figs))
    print(
        f"\nsmall jobs: {n} one-sequence jobs of ~200 tokens offered at {args.rate:.0f} jobs/s, "
        f"no-op scorer sleeping {args.noop_delay_ms:g} ms per batch, one worker"
    )
    print(f"{'max-wait-ms':>11} {'loop':<14} {'jobs/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for wait, mode, f in rows:
        print(
            f"{wait:>11} {mode:<14} {f['jobs_per_s']:>8.1f} {f['p50_ms']:>8.1f} {f['p99_ms']:>8.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
