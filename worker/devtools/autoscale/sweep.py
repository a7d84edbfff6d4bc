"""The autoscaling sweep: KEDA/HPA settings over RL workloads, the table, the pick and its plots.

``scoring-worker bench --suite autoscale`` (``python -m worker.devtools.autoscale.sweep``): every
setting of the grid (pollingInterval, lagCount, activationLagCount, cooldownPeriod,
minReplicaCount 0 or 1, the scale-down stabilization window and policy) runs the same RL workload
(B x G rollouts per step, ``--steps`` steps) for each generation phase (``--gen-s``, default
30, 120 and 600 s) on a fleet of workers with the measured cost per token and start-up time.

Each setting's cost at one generation phase is the device-seconds of a step: the fleet's pod-seconds
plus ``--trainer-devices`` times the trainer's wait for scores (the trainer's devices idle
meanwhile). The pick is the setting whose cost, relative to the best setting of each phase,
is lowest on average over the phases (one ScaledObject serves every phase a run may have); ties go
to fewer scale events, then to the longer pollingInterval. It prints the best settings per phase,
the pick with minReplicaCount 0 and 1 side by side, what shipped before, and writes the plots of
the pick (``--out``, and ``--doc-plot`` for docs/img/).

Defaults of the worker: ``--us-per-token 1706`` is SmolLM2-135M end to end through a worker on
this project's 2-core CPU machine (14,013 tokens in 23.9 s, docs/performance.md, "End to end on
a real model"); ``--startup-s 9.3`` is the slowest measured start of a SmolLM2-135M safetensors
worker to ``/readyz`` on that machine (3.7-9.3 s; 15 s from GGUF). For a GPU fleet pass its own
figures: the cost per token from ``scoring-worker bench``, the start-up from pod creation to
``/readyz`` (mostly reading the weights for 7-70B models).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from worker.devtools.autoscale.fleet import Profile
from worker.devtools.autoscale.hpa import Policy
from worker.devtools.autoscale.keda import ScaledObject
from worker.devtools.autoscale.recommended import RECOMMENDED
from worker.devtools.autoscale.report import format_rows, label, plot_runs
from worker.devtools.autoscale.sim import RunResult, mean_result, simulate
from worker.devtools.autoscale.workload import RlWorkload

SHIPPED_BEFORE = ScaledObject(
    polling_interval_s=10,
    cooldown_s=300,
    min_replicas=0,
    max_replicas=16,
    lag_count=64,
    activation_lag_count=0,
    scale_down_window_s=300,
    scale_down_policies=(Policy("Pods", 1, 60),),
)
"""What ``ops/k8s/keda-scaledobject.yaml`` shipped before the sweep chose its values."""

LOOP_PHASES = (0.2, 0.6)
"""Where in their periods KEDA's and the HPA's loops first run; each setting's figures are the
mean over these (the loops' phase against the bursts moves every figure by a sync period)."""

SCALE_DOWN_POLICIES = {
    "1 pod/60s": (Policy("Pods", 1, 60),),
    "100%/15s": (Policy("Percent", 100, 15),),
}


@dataclass(frozen=True)
class Grid:
    """The values swept (every combination; cooldown and activation only with min 0)."""

    polling_s: tuple[float, ...] = (5, 15, 30)
    lag_count: tuple[int, ...] = (16, 64, 256)
    activation: tuple[int, ...] = (0, 64)
    cooldown_s: tuple[float, ...] = (60, 300, 900)
    min_replicas: tuple[int, ...] = (0, 1)
    window_s: tuple[float, ...] = (60, 300)
    down_policy: tuple[str, ...] = tuple(SCALE_DOWN_POLICIES)
    combine: tuple[str, ...] = ("max", "sum")

    def settings(self, max_replicas: int, partitions: int) -> Iterator[ScaledObject]:
        """Every ScaledObject of the grid."""
        for poll, lag, mn, win, pol, comb in itertools.product(
            self.polling_s,
            self.lag_count,
            self.min_replicas,
            self.window_s,
            self.down_policy,
            self.combine,
        ):
            base = ScaledObject(
                polling_interval_s=poll,
                lag_count=lag,
                min_replicas=mn,
                max_replicas=max_replicas,
                partitions=partitions,
                scale_down_window_s=win,
                scale_down_policies=SCALE_DOWN_POLICIES[pol],
                combine=comb,
            )
            if mn > 0:  # KEDA ignores activation and cooldown with minReplicaCount >= 1
                yield base
                continue
            for act, cool in itertools.product(self.activation, self.cooldown_s):
                yield replace(base, activation_lag_count=act, cooldown_s=cool)


QUICK_GRID = Grid(
    polling_s=(5, 30),
    lag_count=(64,),
    activation=(0,),
    cooldown_s=(60, 300),
    window_s=(60, 300),
    down_policy=("1 pod/60s",),
    combine=("max", "sum"),
)


def pick(
    results: dict[ScaledObject, dict[float, RunResult]], trainer_devices: float
) -> list[tuple[float, ScaledObject]]:
    """Settings ranked by mean relative cost over the phases (best first)."""
    phases = next(iter(results.values())).keys()
    best = {g: min(r[g].cost(trainer_devices) for r in results.values()) for g in phases}

    def key(item: tuple[ScaledObject, dict[float, RunResult]]) -> tuple[float, float, float]:
        spec, runs = item
        score = statistics.fmean(runs[g].cost(trainer_devices) / best[g] for g in phases)
        events = statistics.fmean(runs[g].scale_events_per_step for g in phases)
        return round(score, 2), round(events, 1), -spec.polling_interval_s

    ranked = sorted(results.items(), key=key)
    return [(key(item)[0], item[0]) for item in ranked]


def run_grid(
    settings: Sequence[ScaledObject],
    phases: Sequence[float],
    workload: RlWorkload,
    profile: Profile,
) -> dict[ScaledObject, dict[float, RunResult]]:
    """Simulate every setting at every generation phase."""
    return {
        spec: {
            g: mean_result(
                [simulate(spec, replace(workload, gen_s=g), profile, phase=f) for f in LOOP_PHASES]
            )
            for g in phases
        }
        for spec in settings
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The sweep's flags."""
    p = argparse.ArgumentParser(
        prog="python -m worker.devtools.autoscale.sweep", description=__doc__.splitlines()[0]
    )
    p.add_argument("--quick", action="store_true", help="a small grid (a smoke run)")
    p.add_argument("--gen-s", default="30,120,600", help="generation phases (s), comma list")
    p.add_argument("--prompts", type=int, default=64, help="B: prompts per step")
    p.add_argument("--group", type=int, default=8, help="G: rollouts per prompt")
    p.add_argument("--steps", type=int, default=6, help="steps per run (the first is not counted)")
    p.add_argument(
        "--us-per-token",
        type=float,
        default=1706.0,
        help="a worker's cost per token, µs (default: SmolLM2-135M on 2 CPU cores)",
    )
    p.add_argument(
        "--startup-s",
        type=float,
        default=9.3,
        help="pod creation to /readyz, s (default: SmolLM2-135M on CPU, slowest)",
    )
    p.add_argument("--max-batch-tokens", type=int, default=16384, help="the worker's budget")
    p.add_argument(
        "--partitions",
        type=int,
        default=4,
        help="partition streams of the queue (default 4: SCORING_PARTITIONS in "
        "ops/k8s/deployment.yaml), each with a lag and a pending trigger",
    )
    p.add_argument(
        "--read-count",
        type=int,
        default=64,
        help="entries one read of a worker asks for at most, split over the partitions "
        "(WorkerConfig.read_count)",
    )
    p.add_argument("--max-replicas", type=int, default=16, help="maxReplicaCount")
    p.add_argument(
        "--trainer-devices",
        type=float,
        default=8.0,
        help="devices the trainer holds idle while it waits for scores",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("build/autoscale"),
        help="directory for the plots and results.json",
    )
    p.add_argument(
        "--doc-plot",
        type=Path,
        default=None,
        help="also write the pick's plot here (docs/img/autoscale.png)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep, print the tables, write the plots; 1 when the pick is not RECOMMENDED."""
    args = parse_args(argv)
    phases = [float(x) for x in args.gen_s.split(",") if x.strip()]
    read = args.read_count  # the daemon splits a read's count over the partitions
    profile = Profile(
        s_per_token=args.us_per_token / 1e6,
        startup_s=args.startup_s,
        max_batch_tokens=args.max_batch_tokens,
        read_count=read,
    )
    workload = RlWorkload(gen_s=phases[0], prompts=args.prompts, group=args.group, steps=args.steps)
    grid = QUICK_GRID if args.quick else Grid()
    fleet = {"max_replicas": args.max_replicas, "partitions": args.partitions}
    settings = list(
        dict.fromkeys(
            [
                *grid.settings(args.max_replicas, args.partitions),
                replace(RECOMMENDED, **fleet),
                replace(SHIPPED_BEFORE, **fleet),
            ]
        )
    )
    started = time.monotonic()
    results = run_grid(settings, phases, workload, profile)
    ranked = pick(results, args.trainer_devices)
    chosen = ranked[0][1]
    print(
        f"autoscale sweep: {len(settings)} settings x {len(phases)} generation phases, "
        f"{workload.rollouts} rollouts per step, {args.steps} steps (first not counted), "
        f"{args.us_per_token:g} us/token, start-up {args.startup_s:g} s, "
        f"{args.partitions} partitions (a worker reads up to {read} entries at once), "
        f"maxReplicaCount {args.max_replicas}, cost = pod-s + {args.trainer_devices:g} x wait "
        f"({time.monotonic() - started:.0f} s)"
    )
    twin = replace(
        chosen,
        min_replicas=1 - min(chosen.min_replicas, 1),
        activation_lag_count=0,
        cooldown_s=300.0,
    )
    named = {
        f"pick ({label(chosen)})": results[chosen],
        f"pick with min {twin.min_replicas}": results.get(twin)
        or run_grid([twin], phases, workload, profile)[twin],
        f"shipped before ({label(SHIPPED_BEFORE)})": results[replace(SHIPPED_BEFORE, **fleet)],
    }
    print(format_rows(results, ranked, phases, args.trainer_devices, named))
    args.out.mkdir(parents=True, exist_ok=True)
    traced = {g: simulate(chosen, replace(workload, gen_s=g), profile, trace=True) for g in phases}
    for path in [args.out / "autoscale.png", *([args.doc_plot] if args.doc_plot else [])]:
        plot_runs(traced, label(chosen), path)
        print(f"plot: {path}")
    dump = [
        {
            "setting": asdict(spec),
            "label": label(spec),
            "runs": {
                str(g): {k: v for k, v in asdict(r).items() if k not in ("samples", "events")}
                for g, r in runs.items()
            },
        }
        for spec, runs in results.items()
    ]
    (args.out / "results.json").write_text(json.dumps(dump, indent=1, default=str))
    same = (
        replace(chosen, max_replicas=RECOMMENDED.max_replicas, partitions=RECOMMENDED.partitions)
        == RECOMMENDED
    )
    print(
        f"pick: {label(chosen)}; "
        + (
            "the values ops/k8s ships (RECOMMENDED)"
            if same
            else f"DIFFERS from RECOMMENDED ({label(RECOMMENDED)}): update "
            "worker/devtools/autoscale/recommended.py and ops/k8s"
        )
    )
    return 0 if same or args.quick else 1


if __name__ == "__main__":
    raise SystemExit(main())
