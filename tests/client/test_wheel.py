"""A trainer's install: the wheel ``make dist`` builds, installed into a clean virtual
environment, gives the client, the integrations and the producer commands without torch (the
base dependencies are redis, msgpack and prometheus-client, fetched from the index)."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import importlib.util, sys
import worker.client, worker.client.aio, worker.integrations.trl, worker.integrations.verl
import worker.integrations.verl_manager
from worker.client import ScoringClient, UnknownQueueError
assert importlib.util.find_spec("torch") is None, "torch is installed"
assert not any(m.split(".")[0] in ("torch", "transformers") for m in sys.modules)
print("ok", worker.client.__file__)
"""


def _run(*cmd: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only what is installed
    proc = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )
    assert proc.returncode == 0, f"{cmd}: {proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_the_wheel_installs_the_client_without_torch(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", dist, ROOT)  # fmt: skip  # what `make dist` runs
    (wheel,) = dist.glob("scoring_worker-*.whl")
    env = tmp_path / "trainer-env"
    venv.EnvBuilder(with_pip=True).create(env)
    python = env / "bin" / "python"
    try:
        _run(python, "-m", "pip", "install", "-q", wheel)
    except AssertionError as exc:  # the index out of reach: the dependencies cannot come
        if "Could not find a version" in str(exc) or "NewConnectionError" in str(exc):
            pytest.skip(f"the package index is out of reach: {exc}")
        raise
    out = _run(python, "-c", CHECK, cwd=tmp_path).stdout
    assert out.startswith("ok ") and str(env) in out  # the wheel's copy, not this checkout's
    helped = _run(env / "bin" / "scoring-worker", "enqueue", "--help", cwd=tmp_path).stdout
    assert "--wait-for-workers" in helped
