"""Nothing orphaned: every command that starts children stops them on SIGTERM, SIGHUP and
SIGINT, and when it is killed by ``kill -9`` (the demo's worker and embedded Valkey, the
supervisor's children, the watchdog that guards what a library spawned)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import redis

from tests.support.daemon import start_demo
from worker.processes.supervisor import ChildSpec, Supervisor, SupervisorConfig

ROOT = Path(__file__).resolve().parents[2]


def _gone(pid: int, within_s: float = 0.0) -> bool:
    deadline = time.monotonic() + within_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie of ours counts as gone once reaped; others are not our children
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return True
        except OSError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


PARENT = """
    import subprocess, sys, time
    from worker.processes.parent_death import Watchdog
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    dog = Watchdog(grace_s=2)
    dog.watch(child.pid)
    print(child.pid, dog.pid, flush=True)
    if sys.argv[1] == "clean":
        dog.disarm()
        print("disarmed", flush=True)
    time.sleep(120)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["kill9", "clean"])
def test_watchdog_stops_watched_pids_when_parent_dies_and_not_when_disarmed(
    tmp_path: Path, how: str
) -> None:
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(PARENT))
    parent = subprocess.Popen(
        [sys.executable, str(script), how], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert parent.stdout is not None
    child_pid, dog_pid = map(int, parent.stdout.readline().split())
    if how == "clean":
        assert parent.stdout.readline().strip() == "disarmed"
        assert _gone(dog_pid, within_s=10), "a disarmed watchdog must exit"
    parent.kill()
    parent.wait(10)
    try:
        if how == "kill9":
            assert _gone(child_pid, within_s=15), "the watched child outlived its parent"
            assert _gone(dog_pid, within_s=5)
        else:
            time.sleep(1.0)
            assert not _gone(child_pid), "a disarmed watchdog stopped the child"
    finally:
        if not _gone(child_pid):
            os.kill(child_pid, signal.SIGKILL)


DRAINING_CHILD = """
    import os, signal, sys, time
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    print("serving", flush=True)
    while not stop:
        time.sleep(0.02)
    open(os.path.join(os.environ["STATE_DIR"], f"drained-{os.getpid()}"), "w").close()
"""


@pytest.mark.timeout(30)
def test_supervisor_sighup_drains_children_with_sigterm(tmp_path: Path) -> None:
    """A closed terminal (SIGHUP) drains every child as SIGTERM does (the child would die
    undrained on a forwarded SIGHUP)."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(DRAINING_CHILD))
    env = dict(os.environ, STATE_DIR=str(tmp_path))
    specs = [ChildSpec(i, f"c-{i}", None, None, (sys.executable, str(script)), env) for i in (0, 1)]
    import io

    sup = Supervisor(
        specs, SupervisorConfig(drain_timeout_s=5, poll_interval_s=0.02), output=io.StringIO()
    )

    def hang_up() -> None:
        time.sleep(1.5)
        os.kill(os.getpid(), signal.SIGHUP)

    t = threading.Thread(target=hang_up)
    t.start()
    code = sup.run(install_signals=True)
    t.join()
    assert code == 0
    assert len(list(tmp_path.glob("drained-*"))) == 2


def _server_pid(url: str) -> int:
    with redis.Redis.from_url(url, socket_timeout=5) as client:
        return int(client.info("server")["process_id"])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name
)
def test_demo_leaves_no_worker_nor_embedded_server_behind(sig: signal.Signals) -> None:
    """``scoring-worker demo`` (embedded Valkey, tiny model, interactive) stopped by SIGTERM
    (``timeout``, systemd, ``docker stop``), SIGHUP, or killed by ``kill -9``."""
    proc, out = start_demo(["--model", "tiny"])
    worker_pid = int(re.search(r"worker: pid (\d+)", out).group(1))  # type: ignore[union-attr]
    url = re.search(r"embedded Valkey at (redis://\S+)", out).group(1)  # type: ignore[union-attr]
    valkey_pid = _server_pid(url)
    proc.send_signal(sig)
    _rest, err = proc.communicate(timeout=90)
    try:
        if sig != signal.SIGKILL:
            assert proc.returncode == 0, err
            assert "worker stopped (exit 0)" in err
            assert f"{sig.name}: shutting down" in err
        assert _gone(worker_pid, within_s=40), "the demo's worker outlived it"
        assert _gone(valkey_pid, within_s=20), "the demo's embedded Valkey outlived it"
    finally:
        for pid in (worker_pid, valkey_pid):
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
