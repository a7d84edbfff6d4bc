"""The simulation's queueing core checked against real workers.

``python -m worker.devtools.autoscale.check [--replicas 1,2]``
(``tests/devtools/test_autoscale_check.py`` runs the same with the test Redis): one arrival trace
of RL-like bursts is replayed

1. through real ``serve --scorer noop`` processes with a fixed per-token cost
   (``--noop-us-per-token``) and per-batch cost (``--noop-delay-ms``), at a fixed replica count,
   each burst in one ``MULTI``/``EXEC`` (Redis serves the blocked workers after it),
   on a real Redis; each job's latency is its result entry's id minus its job entry's id (Redis's
   own clock, to the millisecond), and the arrival times replayed are the job entries' ids too;
2. through :func:`worker.devtools.autoscale.sim.replay` with the same arrivals, sizes, costs,
   token budget and replica count.

The p50 and p99 latencies of the two must agree within ``REL_TOLERANCE`` of the measured value
or ``ABS_TOLERANCE_S``, whichever is larger. The trace has bursts smaller than one worker's
first read (64 entries), which one worker takes whole however many run, and a larger burst,
which spreads as each worker reads about one batch ahead: a core that ignored batching (each job
alone), the read size (an ideal shared queue) or the replica count misses by more than the
tolerance (the test shows each such change failing on the same measured runs).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from worker import keys
from worker.devtools.autoscale.fleet import Profile
from worker.devtools.autoscale.sim import percentile, replay
from worker.processes.local import LocalWorker, stop_all, wait_readers
from worker.protocol import decode_result, encode_job

REL_TOLERANCE = 0.15
"""How far simulated p50/p99 may be from the measured ones, relative to the measured value (the
core agrees within 1-3% on this machine at load averages up to 2.7; a core that reads 1 entry,
or a fixed 16 or 64, is 20-26% off the 2-replica p50)."""
ABS_TOLERANCE_S = 0.08
"""The absolute floor of the tolerance (scheduling noise of a loaded 2-core machine)."""


@dataclass(frozen=True)
class Trace:
    """Bursts of jobs: ``(offset_s, jobs)`` each, sizes drawn from ``tokens`` with ``seed``."""

    bursts: tuple[tuple[float, int], ...] = ((0.0, 40), (2.0, 40), (4.0, 150), (9.0, 40))
    tokens: tuple[int, int] = (128, 512)
    seed: int = 3

    def arrivals(self) -> list[tuple[float, int]]:
        """``[(offset_s, tokens)]`` of every job, in order."""
        rng = random.Random(self.seed)
        return [(t, rng.randint(*self.tokens)) for t, n in self.bursts for _ in range(n)]


@dataclass(frozen=True)
class Costs:
    """The real workers' costs and batching, as serve flags."""

    us_per_token: float = 100.0
    delay_ms: float = 30.0
    max_batch_tokens: int = 2048

    def profile(self, extra_batch_s: float = 0.0) -> Profile:
        """The simulation's worker profile for these costs."""
        return Profile(
            s_per_token=self.us_per_token / 1e6,
            startup_s=0.0,
            batch_overhead_s=self.delay_ms / 1000.0 + extra_batch_s,
            max_batch_tokens=self.max_batch_tokens,
        )


@dataclass
class Measured:
    """One real run: the arrivals as Redis stamped them and each job's latency."""

    replicas: int
    arrivals: list[tuple[float, int]]
    latencies: list[float]


def _ms(entry_id: bytes | str) -> int:
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.split("-", 1)[0])


def run_real(
    url: str, queue: str, trace: Trace, replicas: int, costs: Costs, timeout_s: float = 120.0
) -> Measured:
    """Replay ``trace`` through ``replicas`` real noop workers on the Redis at ``url``."""
    client = redis.Redis.from_url(url)
    stream = keys.job_streams(queue)[0]
    reply = keys.reply_stream(stream, "check")
    client.delete(stream, reply)
    client.xgroup_create(stream, keys.DEFAULT_GROUP, id="$", mkstream=True)
    names = [f"{queue}-w{i}" for i in range(replicas)]
    args = [
        "--scorer",
        "noop",
        "--redis-url",
        url,
        "--queue",
        queue,
        "--metrics-port",
        "-1",
        "--noop-delay-ms",
        str(costs.delay_ms),
        "--noop-us-per-token",
        str(costs.us_per_token),
        "--max-batch-tokens",
        str(costs.max_batch_tokens),
        "--result-maxlen",
        "100000",
    ]
    procs = [
        LocalWorker(
            [*args, "--consumer", n],
            log_level="WARNING",
            env={"OMP_NUM_THREADS": "1"},
            stdin=subprocess.DEVNULL,
        ).proc
        for n in names
    ]
    arrivals = trace.arrivals()
    try:
        wait_readers(client, names, procs, timeout_s)
        ids = _replay(client, stream, reply, arrivals)
        deadline = time.monotonic() + timeout_s
        while client.xlen(reply) < len(arrivals):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"only {client.xlen(reply)} of {len(arrivals)} results")
            time.sleep(0.05)
    finally:
        stop_all(procs)
    done: dict[str, int] = {}
    entries: Any = client.xrange(reply)
    for entry_id, fields in entries:
        res = decode_result(fields[b"payload"])
        if not res.ok:
            raise RuntimeError(f"job {res.id} failed: {res.error}")
        done.setdefault(res.id, _ms(entry_id))
    client.delete(stream, reply, keys.dead_letter_stream(stream))
    t0 = min(ids.values())
    burst_ms: dict[float, int] = {}  # a burst's jobs share one EXEC: its first entry's time
    for i, (offset, _tokens) in enumerate(arrivals):
        burst_ms[offset] = min(burst_ms.get(offset, ids[f"j{i}"]), ids[f"j{i}"])
    stamped = [((burst_ms[t] - t0) / 1000.0, tokens) for t, tokens in arrivals]
    latencies = [(done[f"j{i}"] - ids[f"j{i}"]) / 1000.0 for i in range(len(arrivals))]
    return Measured(replicas, stamped, latencies)


def _replay(
    client: redis.Redis, stream: str, reply: str, arrivals: Sequence[tuple[float, int]]
) -> dict[str, int]:
    """XADD each job at its offset (a burst in one MULTI/EXEC); job id -> entry id ms."""
    rng = random.Random(11)
    payloads = [
        encode_job(
            f"j{i}",
            "reference",
            reply,
            [{"tokens": array("i", [rng.randrange(1, 30000) for _ in range(n)]), "prompt_len": 1}],
        )
        for i, (_t, n) in enumerate(arrivals)
    ]
    start = time.monotonic()
    ids: dict[str, int] = {}
    i = 0
    while i < len(arrivals):
        at = arrivals[i][0]
        time.sleep(max(0.0, start + at - time.monotonic()))
        pipe = client.pipeline(transaction=True)  # one burst lands at once (MULTI/EXEC)
        first = i
        while i < len(arrivals) and arrivals[i][0] == at:
            pipe.xadd(stream, {b"payload": payloads[i]})
            i += 1
        for k, entry_id in enumerate(pipe.execute(), start=first):
            ids[f"j{k}"] = _ms(entry_id)
    return ids


@dataclass
class Comparison:
    """Measured and simulated percentiles of one replica count, and whether they agree."""

    replicas: int
    measured: tuple[float, float]
    simulated: tuple[float, float]

    @property
    def ok(self) -> bool:
        """Both p50 and p99 within the tolerance."""
        return all(
            abs(s - m) <= max(REL_TOLERANCE * m, ABS_TOLERANCE_S)
            for m, s in zip(self.measured, self.simulated, strict=True)
        )

    def row(self) -> str:
        """One line of the check's table."""
        (m50, m99), (s50, s99) = self.measured, self.simulated
        verdict = "ok" if self.ok else "DIFFERS"
        return f"{self.replicas:>8} {m50:>9.3f} {s50:>9.3f} {m99:>9.3f} {s99:>9.3f}  {verdict}"


def compare(measured: Measured, costs: Costs, extra_batch_s: float = 0.0) -> Comparison:
    """Simulate the measured arrivals and compare the latency percentiles."""
    sim = replay(measured.arrivals, measured.replicas, costs.profile(extra_batch_s))
    pct = lambda xs: (percentile(xs, 50), percentile(xs, 99))  # noqa: E731
    return Comparison(measured.replicas, pct(measured.latencies), pct(sim))


HEADER = f"{'replicas':>8} {'p50 real':>9} {'p50 sim':>9} {'p99 real':>9} {'p99 sim':>9}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check against a throwaway redis-server; exit 1 when a replica count differs."""
    from worker.devtools.bench.capacity import RedisProcess

    p = argparse.ArgumentParser(
        prog="python -m worker.devtools.autoscale.check", description=__doc__.splitlines()[0]
    )
    p.add_argument("--replicas", default="1,2", help="comma list of fixed replica counts")
    p.add_argument("--redis-url", default=None, help="use this Redis (default: start one)")
    args = p.parse_args(argv)
    server: Any = None if args.redis_url else RedisProcess()
    url = args.redis_url or server.url
    costs, trace = Costs(), Trace()
    print(
        f"trace: bursts {trace.bursts} (offset s, jobs), {trace.tokens} tokens per job; "
        f"noop {costs.us_per_token:g} us/token + {costs.delay_ms:g} ms/batch, "
        f"budget {costs.max_batch_tokens} tokens; tolerance {REL_TOLERANCE:.0%} or "
        f"{ABS_TOLERANCE_S * 1000:.0f} ms"
    )
    print(HEADER)
    worst = 0
    try:
        for n in (int(x) for x in args.replicas.split(",")):
            c = compare(run_real(url, f"ascheck{os.getpid()}r{n}", trace, n, costs), costs)
            print(c.row(), flush=True)
            worst = max(worst, 0 if c.ok else 1)
    finally:
        if server is not None:
            server.stop()
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
