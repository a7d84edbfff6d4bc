"""End-to-end benchmark: the same ragged jobs through Redis and one worker vs in-process.

``python -m worker.devtools.bench.e2e [--quick] [--redis-url URL] [--json PATH]`` (also
``scoring-worker bench --suite e2e``). Without ``--redis-url`` an embedded Valkey is started.

1. A tiny Llama (the worst case for queue overhead: the forward is cheap, so any per-job cost of
   the queue shows) is saved to a temporary directory; ragged jobs are drawn with a fixed seed.
2. In-process: one ``StatelessExecutor`` scores the jobs in chunks under the same
   ``max_batch_tokens`` the worker uses.
3. End to end: two ``python -m worker serve`` subprocesses on the same model and flags, one
   pipelined (the default: the forward overlaps Redis reads and writes) and one with
   ``--no-pipeline``; every job is ``XADD``-ed in one pipeline and the clock runs until the last
   result is read from the reply stream.

Each path first runs one untimed warm-up pass over all jobs (first-time kernel and shape costs on
CPU are large and would otherwise land on whichever path runs first), then ``--rounds`` (5) timed
rounds, each running the three paths back to back in a rotating order (so all see the same
machine load). A round's ratio is in-process seconds over end-to-end seconds; the median round is
reported.

Prints jobs/s and tokens/s of each path and the median ratios (target: pipelined end-to-end
>= 0.95x in-process).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from worker import keys
from worker.demo.embedded import redis_url_or_embedded
from worker.processes.local import LocalWorker
from worker.protocol import decode_result, encode_job

GROUP = keys.DEFAULT_GROUP


def build_model(directory: Path, vocab: int = 1024) -> str:
    """Save the tiny benchmark Llama (seed 0) to ``directory``; returns its path."""
    from worker.demo.tiny import llama_config, random_model

    model = random_model("LlamaForCausalLM", llama_config(vocab, 64, 128, 1024), 0)
    model.save_pretrained(directory)
    return str(directory)


def make_jobs(
    n: int, seqs_per_job: int, min_len: int, max_len: int, vocab: int, seed: int = 0
) -> list[list[dict[str, Any]]]:
    """``n`` jobs of ``seqs_per_job`` ragged sequences (prompt a quarter of each)."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        seqs = []
        for _ in range(seqs_per_job):
            length = rng.randint(min_len, max_len)
            tokens = [rng.randrange(1, vocab) for _ in range(length)]
            seqs.append({"tokens": tokens, "prompt_len": max(1, length // 4)})
        jobs.append(seqs)
    return jobs


class InProcess:
    """The in-process path: one ``StatelessExecutor`` scoring the jobs in chunks under the same
    ``max_batch_tokens`` the worker uses."""

    def __init__(
        self,
        model: str,
        jobs: list[list[dict[str, Any]]],
        max_batch_tokens: int,
        packing: str,
        threads: int,
    ) -> None:
        import torch

        from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor

        self.executor = StatelessExecutor.from_pretrained(
            ExecutorConfig(
                mode="reference",
                device="cpu",
                max_batch_tokens=max_batch_tokens,
                packing=packing,  # type: ignore[arg-type]
            ),
            reference_model=model,
        )
        self.jobs = [[SequenceInput(s["tokens"], s["prompt_len"]) for s in job] for job in jobs]
        self.max_batch_tokens = max_batch_tokens
        torch.set_num_threads(threads)

    def one_pass(self) -> float:
        """Seconds to score every job once."""
        start = time.perf_counter()
        chunk: list[Any] = []
        tokens = 0
        for job in self.jobs:
            n = sum(len(s.tokens) for s in job)
            if chunk and tokens + n > self.max_batch_tokens:
                self.executor.score(chunk, mode="reference")
                chunk, tokens = [], 0
            chunk.extend(job)
            tokens += n
        if chunk:
            self.executor.score(chunk, mode="reference")
        return time.perf_counter() - start


def collect_results(client: Any, reply: str, n: int, timeout_s: float) -> int:
    """Read ``reply`` until ``n`` distinct results arrived; returns how many were ok."""
    seen: dict[str, bool] = {}
    last = "0-0"
    deadline = time.monotonic() + timeout_s
    while len(seen) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(seen)}/{n} results after {timeout_s}s")
        for _stream, entries in client.xread({reply: last}, count=10000, block=200) or []:
            for entry_id, fields in entries:
                last = entry_id.decode()
                res = decode_result(fields[b"payload"])
                seen.setdefault(res.id, res.ok)
    return sum(seen.values())


class EndToEnd:
    """The queue path: one ``python -m worker serve`` subprocess on the same model and flags
    (``pipeline`` False: ``--no-pipeline``); a pass ``XADD``s every job in one pipeline and ends
    when the last result is read."""

    def __init__(
        self,
        url: str,
        model: str,
        jobs: list[list[dict[str, Any]]],
        max_batch_tokens: int,
        packing: str,
        log_path: Path,
        threads: int,
        pipeline: bool = True,
    ) -> None:
        tag = f"bench{os.getpid()}{'' if pipeline else 'np'}"
        self.stream = keys.job_streams(tag)[0]
        self.reply = keys.reply_stream(self.stream, "bench")
        self.jobs = jobs
        self.log_path = log_path
        self.client = redis.Redis.from_url(url)
        self.client.delete(self.stream, self.reply)
        self.worker = LocalWorker(
            ["--redis-url", url, "--queue", tag, "--reference-model", model, "--device", "cpu",
             "--consumer", "bench", "--max-batch-tokens", str(max_batch_tokens),
             "--packing", packing, "--metrics-port", "-1",
             *([] if pipeline else ["--no-pipeline"])],
            log_path=log_path, log_level="WARNING",
            env={"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)},
        )  # fmt: skip

    def one_pass(self, tag: str) -> float:
        """Seconds from the first ``XADD`` of every job to the last result."""
        self.client.delete(self.reply)
        payloads = [
            encode_job(f"{tag}{i}", "reference", self.reply, seqs)
            for i, seqs in enumerate(self.jobs)
        ]
        start = time.perf_counter()
        pipe = self.client.pipeline(transaction=False)
        for p in payloads:
            pipe.xadd(self.stream, {"payload": p})
        pipe.execute()
        ok = collect_results(self.client, self.reply, len(self.jobs), timeout_s=600)
        elapsed = time.perf_counter() - start
        if ok != len(self.jobs):
            raise RuntimeError(f"{len(self.jobs) - ok} jobs failed; see {self.log_path}")
        return elapsed

    def close(self) -> None:
        """Stop the worker and delete the benchmark's keys."""
        self.worker.stop(60)
        self.client.delete(self.stream, self.reply, keys.dead_letter_stream(self.stream))


def run_side_by_side(
    url: str,
    model: str,
    jobs: list[list[dict[str, Any]]],
    max_batch_tokens: int,
    packing: str,
    log_path: Path,
    rounds: int,
    threads: int,
) -> dict[str, list[float]]:
    """Seconds per round of each path (``in-process``, ``pipelined``, ``sequential``): one untimed
    warm-up pass of each (first-time kernel and shape costs, the workers' model load), then
    ``rounds`` rounds running the paths back to back in a rotating order so all see the same
    machine load."""
    in_proc = InProcess(model, jobs, max_batch_tokens, packing, threads)
    piped = EndToEnd(url, model, jobs, max_batch_tokens, packing, log_path, threads)
    seq_log = log_path.with_name(log_path.stem + "-np.log")
    plain = EndToEnd(url, model, jobs, max_batch_tokens, packing, seq_log, threads, False)
    paths = {
        "in-process": lambda _tag: in_proc.one_pass(),
        "pipelined": piped.one_pass,
        "sequential": plain.one_pass,
    }
    try:
        for run in paths.values():
            run("warm")
        times: dict[str, list[float]] = {name: [] for name in paths}
        names = list(paths)
        for r in range(rounds):
            for name in names[r % 3 :] + names[: r % 3]:
                times[name].append(paths[name](f"r{r}-"))
        return times
    finally:
        piped.close()
        plain.close()


def median_round(times: dict[str, list[float]], path: str) -> tuple[float, float, float]:
    """(ratio, in-process s, ``path`` s) of the round whose in-process / ``path`` ratio is the
    median (the lower middle one for an even count)."""
    rounds = sorted(zip(times["in-process"], times[path], strict=True), key=lambda t: t[0] / t[1])
    in_s, e2e_s = rounds[(len(rounds) - 1) // 2]
    return in_s / e2e_s, in_s, e2e_s


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Flags of the e2e benchmark."""
    p = argparse.ArgumentParser(prog="bench_e2e", description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", default=None, help="default: an embedded Valkey")
    p.add_argument("--jobs", type=int, default=400)
    p.add_argument("--seqs-per-job", type=int, default=4)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument(
        "--packing",
        choices=["auto", "packed", "unmasked", "padded"],  # ExecutorConfig.packing
        default="padded",
        help="executor packing on both paths (padded: the cheapest CPU forward, so the queue's "
        "share of the time is largest)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads on both paths (1 leaves a core for Redis and the producer, "
        "and keeps OpenMP spin-waits out of a loaded machine's figures)",
    )
    p.add_argument(
        "--rounds", type=int, default=5, help="timed rounds of the three paths (median is kept)"
    )
    p.add_argument("--quick", action="store_true", help="100 jobs, 1 timed round")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run both paths and print the comparison."""
    args = parse_args(argv)
    n_jobs = min(args.jobs, 100) if args.quick else args.jobs
    jobs = make_jobs(n_jobs, args.seqs_per_job, args.min_len, args.max_len, vocab=1024)
    tokens = sum(len(s["tokens"]) for job in jobs for s in job)
    with (
        redis_url_or_embedded(args.redis_url) as url,
        tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp,
    ):
        model = build_model(Path(tmp) / "model")
        rounds = 1 if args.quick else max(1, args.rounds)
        times = run_side_by_side(
            url,
            model,
            jobs,
            args.max_batch_tokens,
            args.packing,
            Path(tmp) / "w.log",
            rounds,
            args.threads,
        )
    ratio, in_proc_s, e2e_s = median_round(times, "pipelined")
    seq_ratio, seq_in_s, seq_s = median_round(times, "sequential")
    print(
        f"\nend-to-end benchmark: {n_jobs} jobs, {n_jobs * args.seqs_per_job} seqs, {tokens} "
        f"tokens, tiny Llama on CPU ({args.threads} thread(s)), "
        f"max_batch_tokens={args.max_batch_tokens}, {args.packing}, median of {rounds} round(s)"
    )
    print(f"{'path':<30} {'seconds':>9} {'jobs/s':>9} {'tokens/s':>10}  rounds (s)")
    rows = {
        "in-process": (in_proc_s, times["in-process"]),
        "redis + 1 worker (pipelined)": (e2e_s, times["pipelined"]),
        "redis + 1 worker (--no-pipeline)": (seq_s, times["sequential"]),
    }
    for name, (secs, all_s) in rows.items():
        listed = " ".join(f"{t:.2f}" for t in all_s)
        print(f"{name:<30} {secs:>9.3f} {n_jobs / secs:>9.1f} {tokens / secs:>10.0f}  {listed}")
    print(
        f"end-to-end / in-process throughput: {ratio:.2f}x pipelined (target >= 0.95x), "
        f"{seq_ratio:.2f}x --no-pipeline (median of {rounds})"
    )
    if args.json:
        figures = {
            "jobs": n_jobs, "tokens": tokens, "rounds": rounds, "in_process_s": in_proc_s,
            "e2e_s": e2e_s, "in_process_jobs_per_s": n_jobs / in_proc_s,
            "e2e_jobs_per_s": n_jobs / e2e_s, "ratio": ratio, "no_pipeline_ratio": seq_ratio,
            "no_pipeline_s": seq_s, "no_pipeline_in_process_s": seq_in_s, "times": times,
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
