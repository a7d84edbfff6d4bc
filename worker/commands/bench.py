"""``scoring-worker bench``: the benchmarks, side by side in one run, printing tables and JSON.

Suites: ``executor`` (naive in-trainer scoring vs the stateless executor), ``floor`` (the
executor's reference-mode time over the least work scoring needs, on SmolLM2-135M and the
synthetic 32k/128k models), ``e2e`` (the same jobs through Redis and a worker, pipelined and not,
vs in-process), ``small`` (1,000 small jobs at a fixed offered rate: jobs/s and latency against
``--max-wait-ms``), ``naive`` (end to end vs naive in-trainer scoring on the synthetic
128k-vocab model and SmolLM2-135M: time and peak RSS), ``dtype`` (SmolLM2 in float32 and
bfloat16 on the CPU), ``capacity`` (queue throughput with the no-op scorer), ``adapters`` (jobs
over 3 resident LoRA adapters vs one model, cold adapter loads, a full-model switch per job),
``gateway`` (the HTTP gateway vs ``score_many``: one-sample requests on the no-op scorer, SmolLM2
log-prob requests), ``tensor-parallel`` (the per-rank memory of a model sharded over 1 and 2
gloo ranks), ``coldstart`` (process start to ``/readyz`` and to the first result, by phase, for a
safetensors and a GGUF checkpoint, with and without ``--warmup``). Extra arguments after ``--``
go to the suite's own ``main``.
"""

from __future__ import annotations

import argparse
import importlib
import time

SUITES = {
    "executor": "worker.devtools.bench.executor",
    "floor": "worker.devtools.bench.floor",
    "e2e": "worker.devtools.bench.e2e",
    "small": "worker.devtools.bench.small",
    "naive": "worker.devtools.bench.naive",
    "dtype": "worker.devtools.bench.dtype",
    "capacity": "worker.devtools.bench.capacity",
    "adapters": "worker.devtools.bench.adapters",
    "gateway": "worker.devtools.bench.gateway",
    "tensor-parallel": "worker.devtools.bench.tensor_parallel",
    "coldstart": "worker.devtools.bench.coldstart",
}

HEADLINE = ("naive", "executor", "floor", "e2e", "small", "dtype")
"""What ``make bench`` runs (under 15 minutes on a 2-core CPU machine): the README's figures.
``dtype`` only where the CPU multiplies bfloat16 natively; ``--suite all`` runs every suite."""


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the bench flags."""
    parser.add_argument(
        "--suite",
        action="append",
        choices=[*SUITES, "all"],
        help="which benchmark(s) to run (repeatable; default: the headline, "
        f"{', '.join(HEADLINE)}; all: every suite, about 50 minutes)",
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    parser.add_argument(
        "suite_args",
        nargs=argparse.REMAINDER,
        help="arguments passed to each suite's main (after --)",
    )


def _headline() -> list[str]:
    from worker.executor.weights.loading import cpu_bf16_support

    if cpu_bf16_support():
        return list(HEADLINE)
    print("dtype: left out (this CPU has no native bfloat16; --suite dtype runs it anyway)")
    return [name for name in HEADLINE if name != "dtype"]


def run(args: argparse.Namespace) -> int:
    """Run the chosen suites in order; the exit code is the worst suite's."""
    suites = args.suite or _headline()
    if "all" in suites:
        suites = list(SUITES)
    extra = [a for a in args.suite_args if a != "--"]
    if args.quick:
        extra = ["--quick", *extra]
    worst = 0
    for name in suites:
        module = importlib.import_module(SUITES[name])
        started = time.monotonic()
        rc = int(module.main(list(extra)) or 0)
        print(f"[bench] {name}: {time.monotonic() - started:.0f} s, exit {rc}", flush=True)
        worst = max(worst, rc)
    return worst
