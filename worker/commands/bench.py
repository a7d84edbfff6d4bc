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
gloo ranks), ``fairness`` (a steady producer's latency while another bursts 20,000 jobs, one
worker: one queue, two queues with equal weights, two with weights), ``autoscale`` (the KEDA/HPA
simulation's sweep over RL workloads: the settings ``ops/k8s`` ships), ``coldstart`` (process
start to ``/readyz`` and to the first result, by phase, for a safetensors and a GGUF checkpoint,
with and without ``--warmup``), ``teacher`` (``hidden`` rows and student text for a teacher with
its own tokenizer, next to a plain log-prob job). Extra arguments after ``--`` go to the suite's
own ``main``.
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
    "fairness": "worker.devtools.bench.fairness",
    "autoscale": "worker.devtools.autoscale.sweep",
    "coldstart": "worker.devtools.bench.coldstart",
    "groups": "worker.devtools.bench.groups",
    "teacher": "worker.devtools.bench.distill",
    "vision": "worker.devtools.bench.vision",
}

HEADLINE: dict[str, tuple[str, ...]] = {
    "naive": ("--rounds", "1"),
    "executor": (),
    "floor": ("--reps", "1"),
    "e2e": (),
    "small": (),
}
"""What ``make bench`` runs, with the arguments that keep it under 15 minutes on a 2-core CPU
machine (one round of ``naive`` and ``floor``; ``--suite NAME`` alone runs a suite's default three
rounds): the README's figures. ``dtype`` (about 3.5 minutes) and ``capacity`` are left to
``--suite``; ``--suite all`` runs every suite."""


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the bench flags."""
    parser.add_argument(
        "--suite",
        action="append",
        choices=[*SUITES, "all"],
        help="which benchmark(s) to run (repeatable; default: the headline, "
        f"{', '.join(HEADLINE)} with fewer rounds; all: every suite, about 50 minutes)",
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    parser.add_argument(
        "suite_args",
        nargs=argparse.REMAINDER,
        help="arguments passed to each suite's main (after --)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the chosen suites in order; the exit code is the worst suite's."""
    headline = not args.suite
    suites = args.suite or list(HEADLINE)
    if "all" in suites:
        suites = list(SUITES)
    extra = [a for a in args.suite_args if a != "--"]
    if args.quick:
        extra = ["--quick", *extra]
    worst = 0
    for name in suites:
        module = importlib.import_module(SUITES[name])
        started = time.monotonic()
        preset = list(HEADLINE[name]) if headline else []
        rc = int(module.main([*preset, *extra]) or 0)
        print(f"[bench] {name}: {time.monotonic() - started:.0f} s, exit {rc}", flush=True)
        worst = max(worst, rc)
    return worst
