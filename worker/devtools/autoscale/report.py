"""The sweep's tables (plain text, also pasted into docs/operations.md) and its plot (PNG)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from worker.devtools.autoscale.keda import ScaledObject
from worker.devtools.autoscale.sim import RunResult

Runs = Mapping[float, RunResult]

HEADER = (
    "| setting | generation phase | trainer wait / step | job p50 | job p99 | pod-s / step "
    "| scale events / step | cold starts / step | cost / step |"
)


def policies(spec: ScaledObject) -> str:
    """The scale-down policies as ``1 pod/60s`` or ``100%/15s``."""
    return ", ".join(
        f"{p.value} pod/{p.period_s:g}s" if p.kind == "Pods" else f"{p.value}%/{p.period_s:g}s"
        for p in spec.scale_down_policies
    )


def label(spec: ScaledObject) -> str:
    """A short name of a setting for the tables."""
    keda = (
        f" act {spec.activation_lag_count} cool {spec.cooldown_s:g}"
        if spec.min_replicas == 0
        else ""
    )
    target = "lag+pending" if spec.combine == "sum" else "lag"
    return (
        f"min {spec.min_replicas} poll {spec.polling_interval_s:g} {target} {spec.lag_count}"
        f"{keda} win {spec.scale_down_window_s:g} down {policies(spec)}"
    )


def row(name: str, gen_s: float, r: RunResult, trainer_devices: float) -> str:
    """One Markdown table row of one run."""
    return (
        f"| {name} | {gen_s:g} s | {r.wait_s:.1f} s | {r.p50_s:.1f} s | {r.p99_s:.1f} s | "
        f"{r.pod_s_per_step:,.0f} | {r.scale_events_per_step:.1f} | "
        f"{r.cold_starts_per_step:.1f} | {r.cost(trainer_devices):,.0f} |"
    )


def format_rows(
    results: Mapping[ScaledObject, Runs],
    ranked: Sequence[tuple[float, ScaledObject]],
    phases: Sequence[float],
    trainer_devices: float,
    named: Mapping[str, Runs],
) -> str:
    """The tables: the named settings side by side per phase, the best per phase, the ranking."""
    out = [
        "",
        "named settings (the pick, the pick with minReplicaCount 1, what shipped before):",
        HEADER,
        "| --- " * 9 + "|",
    ]
    for g in phases:
        out.extend(row(name, g, runs[g], trainer_devices) for name, runs in named.items())
    out += ["", "best per generation phase:", HEADER, "| --- " * 9 + "|"]
    for g in phases:
        best = sorted(results, key=lambda s: results[s][g].cost(trainer_devices))[:3]
        out.extend(row(label(s), g, results[s][g], trainer_devices) for s in best)
    out += ["", "ranking (mean cost relative to each phase's best; lower is better):"]
    out.extend(f"  {score:.2f}  {label(spec)}" for score, spec in ranked[:10])
    worst = ranked[-1]
    stranded = sum(1 for runs in results.values() if any(r.stranded for r in runs.values()))
    out.append(
        f"  ... {len(ranked)} settings, worst {worst[0]:.2f}: {label(worst[1])}; "
        f"{stranded} settings stranded the tail batch at some phase (an activation above its size)"
    )
    return "\n".join(out)


def plot_runs(traced: Runs, title: str, path: Path) -> None:
    """Replicas, ready pods, lag and pending over time, one panel per generation phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traced), 1, figsize=(10, 2.8 * len(traced)), squeeze=False)
    for ax, (gen_s, run) in zip(axes[:, 0], traced.items(), strict=True):
        t = [s.t for s in run.samples]
        ax.step(t, [s.replicas for s in run.samples], where="post", label="replicas (spec)")
        ax.step(t, [s.ready for s in run.samples], where="post", label="ready pods")
        ax.set_ylabel("pods")
        ax.set_title(
            f"generation phase {gen_s:g} s: trainer wait {run.wait_s:.0f} s/step, "
            f"{run.pod_s_per_step:,.0f} pod-s/step",
            fontsize=9,
        )
        right = ax.twinx()
        right.plot(t, [s.lag for s in run.samples], color="tab:red", lw=0.8, label="lag")
        right.plot(t, [s.pending for s in run.samples], color="tab:gray", lw=0.8, label="pending")
        right.set_ylabel("entries")
        lines = ax.get_legend_handles_labels()
        more = right.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
