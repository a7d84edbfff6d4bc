"""Fairness: a steady producer's latency while another bursts, one worker, with and without queues.

``python -m worker.devtools.bench.fairness [--quick] [--json PATH]`` (also ``scoring-worker
bench --suite fairness``; not part of ``make bench``).

One ``serve --scorer noop`` worker with a fixed per-batch delay (``--noop-delay-ms``: a stand-in
for a forward, so batches cost time like a model's) and two producers: *burst* puts 20,000 jobs
at once, *steady* submits jobs at a fixed rate, a fraction (``--steady-share``, default 0.6) of
the worker's capacity measured first with a backlog. A job is one 64-token sequence; a batch holds
``--max-batch-tokens`` (default 2,048: 32 jobs). Three set-ups, each with a fresh worker, side by
side in one run:

1. ``one queue``: both producers on one queue (``serve --queue shared``): the steady jobs wait
   behind the burst (first in, first out);
2. ``two queues 1:1``: ``serve --queue steady --queue burst`` (equal weights): each backlogged
   queue gets half of every batch's tokens;
3. ``two queues 3:1``: ``serve --queue steady:3 --queue burst:1`` (``--weights``).

The steady producer runs from the start of the burst until the burst's last result; its latency
(result read minus submission, in this process) is reported as p50/p99/max over those jobs,
with the time the burst took to drain. The bench starts its own ``redis-server`` (no
persistence) unless ``--redis-url`` is given. About a minute on 2 cores (``--quick``: a
2,000-job burst, seconds).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis

from worker import keys
from worker.devtools.bench.capacity import RedisProcess
from worker.processes.local import LocalWorker
from worker.protocol import decode_result, encode_job

TOKENS = 64
PROMPT_LEN = 16


@dataclass
class Scenario:
    """One set-up: the worker's ``--queue`` flags and where each producer puts its jobs."""

    name: str
    queue_flags: list[str]
    steady_queue: str
    burst_queue: str


@dataclass
class Figures:
    """What one set-up measured."""

    scenario: str
    steady_jobs: int
    steady_p50_ms: float
    steady_p99_ms: float
    steady_max_ms: float
    burst_jobs: int
    burst_drain_s: float
    errors: int


SEQ = array("i", [(7 * i + 3) % 30000 for i in range(TOKENS)])


def _payload(job_id: str, reply: str) -> bytes:
    return encode_job(job_id, "reference", reply, [{"tokens": SEQ, "prompt_len": PROMPT_LEN}])


def _start_worker(url: str, flags: list[str], args: argparse.Namespace, log: Path) -> LocalWorker:
    """A noop ``serve`` subprocess logging to ``log``; ``stop()``: SIGTERM, SIGKILL after 30 s."""
    cmd = [
        "--redis-url", url, *flags, "--scorer", "noop",
        "--noop-delay-ms", str(args.noop_delay_ms),
        "--max-batch-tokens", str(args.max_batch_tokens), "--consumer", "fair",
        "--metrics-port", "-1", "--result-maxlen", str(4 * args.burst + 100000),
        "--block-ms", "100",
    ]  # fmt: skip
    return LocalWorker(
        cmd,
        log_path=log,
        append=True,
        log_level="WARNING",
        env={"OMP_NUM_THREADS": "1"},
        stdin=subprocess.DEVNULL,
    )


def _wait_results(client: Any, reply: str, n: int, proc: LocalWorker, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while int(client.xlen(reply)) < n:
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited with {proc.poll()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {client.xlen(reply)}/{n} results after {timeout_s} s")
        time.sleep(0.02)


def capacity(url: str, args: argparse.Namespace, log: Path) -> float:
    """Jobs/s of the worker draining a backlog of ``args.calibrate`` jobs (one queue)."""
    client: Any = redis.Redis.from_url(url)
    stream = keys.job_streams(f"{args.prefix}calib")[0]
    reply = keys.reply_stream(stream, "bench")
    proc = _start_worker(url, ["--queue", f"{args.prefix}calib"], args, log)
    try:
        client.xadd(stream, {"payload": _payload("w", reply)})
        _wait_results(client, reply, 1, proc, 120)  # up and serving
        client.delete(reply)
        pipe = client.pipeline(transaction=False)
        for i in range(args.calibrate):
            pipe.xadd(stream, {"payload": _payload(f"c{i}", reply)})
        pipe.execute()
        started = time.perf_counter()
        _wait_results(client, reply, args.calibrate, proc, 300)
        return args.calibrate / (time.perf_counter() - started)
    finally:
        proc.stop()
        client.delete(stream, reply, keys.dead_letter_stream(stream))


def run_scenario(
    url: str, sc: Scenario, rate: float, args: argparse.Namespace, log: Path
) -> Figures:
    """One set-up: a fresh worker, the burst and the steady producer at ``rate`` jobs/s."""
    client: Any = redis.Redis.from_url(url)
    steady_stream = keys.job_streams(sc.steady_queue)[0]
    burst_stream = keys.job_streams(sc.burst_queue)[0]
    steady_reply = keys.reply_stream(steady_stream, "steady")
    burst_reply = keys.reply_stream(burst_stream, "burst")
    used = {steady_stream, burst_stream, steady_reply, burst_reply}
    client.delete(*used)
    proc = _start_worker(url, sc.queue_flags, args, log)
    sent: dict[str, float] = {}
    arrived: dict[str, float] = {}
    errors = [0]
    stop, sending_done = threading.Event(), threading.Event()
    try:
        client.xadd(steady_stream, {"payload": _payload("warm", steady_reply)})
        _wait_results(client, steady_reply, 1, proc, 120)
        client.delete(steady_reply)
        burst = [_payload(f"b{k}", burst_reply) for k in range(args.burst)]

        def produce() -> None:
            producer: Any = redis.Redis.from_url(url)
            start = time.perf_counter()
            i = 0
            while not stop.is_set():
                due = int((time.perf_counter() - start) * rate) + 1
                if due > i:
                    pipe = producer.pipeline(transaction=False)
                    for k in range(i, due):
                        pipe.xadd(steady_stream, {"payload": _payload(f"s{k}", steady_reply)})
                    now = time.perf_counter()
                    pipe.execute()
                    for k in range(i, due):
                        sent[f"s{k}"] = now
                    i = due
                time.sleep(0.001)

        def read() -> None:
            reader: Any = redis.Redis.from_url(url)
            last = "0-0"
            while not (sending_done.is_set() and len(arrived) >= len(sent)):
                for _s, entries in reader.xread({steady_reply: last}, count=1000, block=100) or []:
                    now = time.perf_counter()
                    for entry_id, fields in entries:
                        last = entry_id.decode()
                        res = decode_result(fields[b"payload"])
                        errors[0] += 0 if res.ok else 1
                        arrived.setdefault(res.id, now)

        threads = [threading.Thread(target=produce), threading.Thread(target=read)]
        for t in threads:
            t.start()
        burst_started = time.time()
        pipe = client.pipeline(transaction=False)
        for k, p in enumerate(burst):
            pipe.xadd(burst_stream, {"payload": p})
            if k % 1000 == 999:
                pipe.execute()
        pipe.execute()
        _wait_results(client, burst_reply, args.burst, proc, 900)
        last_ms = int(client.xrevrange(burst_reply, count=1)[0][0].decode().split("-")[0])
        stop.set()
        threads[0].join()
        sending_done.set()
        threads[1].join(300)
        for _id, fields in client.xrange(burst_reply):
            errors[0] += 0 if decode_result(fields[b"payload"]).ok else 1
    finally:
        stop.set()
        sending_done.set()
        proc.stop()
        client.delete(*used, *(keys.dead_letter_stream(s) for s in (steady_stream, burst_stream)))
    missing = set(sent) - set(arrived)
    if missing:
        raise RuntimeError(f"{len(missing)} steady jobs without a result; see {log}")
    lat = sorted((arrived[j] - sent[j]) * 1000.0 for j in sent)
    n = len(lat)
    return Figures(
        scenario=sc.name,
        steady_jobs=n,
        steady_p50_ms=round(lat[n // 2], 1),
        steady_p99_ms=round(lat[min(n - 1, int(n * 0.99))], 1),
        steady_max_ms=round(lat[-1], 1),
        burst_jobs=args.burst,
        burst_drain_s=round(last_ms / 1000.0 - burst_started, 2),
        errors=errors[0],
    )


def scenarios(weights: tuple[int, int], prefix: str = "") -> list[Scenario]:
    """The three set-ups (``weights``: steady's and burst's in the third; ``prefix`` goes before
    every queue name)."""
    s, b = weights
    shared, steady, burst = f"{prefix}shared", f"{prefix}steady", f"{prefix}burst"
    return [
        Scenario("one queue", ["--queue", shared], shared, shared),
        Scenario("two queues 1:1", ["--queue", steady, "--queue", burst], steady, burst),
        Scenario(
            f"two queues {s}:{b}",
            ["--queue", f"{steady}:{s}", "--queue", f"{burst}:{b}"],
            steady,
            burst,
        ),
    ]


def _weights(text: str) -> tuple[int, int]:
    steady, _, burst = text.partition(":")
    return int(steady), int(burst or 1)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure the capacity, run the three set-ups, print the table (and write JSON)."""
    p = argparse.ArgumentParser(prog="bench_fairness", description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", default=None, help="default: a redis-server of its own")
    p.add_argument("--burst", type=int, default=20000, help="jobs of the bursting producer")
    p.add_argument("--steady-share", type=float, default=0.6,
                   help="steady rate, a fraction of the measured capacity")  # fmt: skip
    p.add_argument("--weights", type=_weights, default=(3, 1), help="steady:burst of set-up 3")
    p.add_argument("--noop-delay-ms", type=float, default=10.0, help="per-batch delay")
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--calibrate", type=int, default=3000, help="jobs of the capacity run")
    p.add_argument("--prefix", default="", help="put before every queue name (a shared Redis)")
    p.add_argument("--quick", action="store_true", help="a 2,000-job burst (a smoke run)")
    p.add_argument("--json", dest="json_path", default=None, help="write the figures here")
    args, _ = p.parse_known_args(argv)
    if args.quick:
        args.burst, args.calibrate = min(args.burst, 2000), min(args.calibrate, 1000)
    server = None if args.redis_url else RedisProcess()
    url = args.redis_url or (server.url if server else "")
    rows: list[Figures] = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-fairness-") as tmp:
            log = Path(tmp) / "worker.log"
            try:
                cap = capacity(url, args, log)
                rate = args.steady_share * cap
                for sc in scenarios(args.weights, args.prefix):
                    rows.append(run_scenario(url, sc, rate, args, log))
            except Exception:
                print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
                raise
    finally:
        if server is not None:
            server.stop()
    print(
        f"\nfairness: one noop worker ({args.noop_delay_ms:g} ms per batch, "
        f"{args.max_batch_tokens} tokens = {args.max_batch_tokens // TOKENS} jobs of {TOKENS} "
        f"tokens), capacity {cap:.0f} jobs/s; burst {args.burst} jobs at once, steady "
        f"{rate:.0f} jobs/s ({args.steady_share:g} of capacity) while the burst drains"
    )
    print(
        f"{'set-up':<18} {'steady jobs':>11} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9} "
        f"{'burst drained s':>15} {'errors':>6}"
    )
    for r in rows:
        print(
            f"{r.scenario:<18} {r.steady_jobs:>11} {r.steady_p50_ms:>9.1f} "
            f"{r.steady_p99_ms:>9.1f} {r.steady_max_ms:>9.1f} {r.burst_drain_s:>15.2f} "
            f"{r.errors:>6}"
        )
    if args.json_path:
        report = {
            "benchmark": "fairness",
            "capacity_jobs_per_s": round(cap, 1),
            "steady_jobs_per_s": round(rate, 1),
            "args": {k: v for k, v in vars(args).items() if k != "json_path"},
            "results": [asdict(r) for r in rows],
        }
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_path}")
    return 1 if any(r.errors for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
