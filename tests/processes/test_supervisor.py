"""The supervisor's own logic: child argv/env, restart with backoff, give-up, drain, SIGKILL.

Children here are tiny Python scripts (no Redis, no model), so each test runs in about a second;
tests/processes/test_supervisor_serve.py runs the real ``serve --replicas 2``.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from worker.errors import ConfigError
from worker.processes.fleet import build_children, child_flags, fleet_dests, parse_gpus
from worker.processes.supervisor import ChildSpec, Supervisor, SupervisorConfig


def _args(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed by the real CLI parser (global flags, then ``serve`` and its flags)."""
    from worker.cli import build_parser

    return build_parser("serve").parse_args(argv)


def _children(argv: list[str], env: dict[str, str]) -> list[ChildSpec]:
    from worker.commands.serve import flag_defaults

    return build_children(_args(argv), flag_defaults(), env=env)


def test_child_argv_drops_fleet_flags_and_numbers_children() -> None:
    argv = ["--log-level", "DEBUG", "serve", "--replicas", "3", "--redis-url", "redis://h:1/0",
            "--consumer=pod", "--metrics-port", "9400", "--burst", "--restart-limit", "2",
            "--exit-on-give-up"]  # fmt: skip
    specs = _children(argv, env={"PATH": "/bin"})
    assert [s.consumer for s in specs] == ["pod-0", "pod-1", "pod-2"]
    assert [s.metrics_port for s in specs] == [9400, 9401, 9402]
    for i, s in enumerate(specs):
        assert s.argv[:4] == (sys.executable, "-m", "worker", "serve")
        assert sorted(s.argv[4:-4]) == ["--burst", "--redis-url=redis://h:1/0"]
        assert s.argv[-4:] == ("--consumer", f"pod-{i}", "--metrics-port", str(9400 + i))
        assert "CUDA_VISIBLE_DEVICES" not in s.env
        assert s.env["SCORING_REPLICA_INDEX"] == str(i)
        assert s.env["SCORING_LOG_LEVEL"] == "DEBUG"  # the global flag reaches the child


def test_child_argv_parses_back_to_the_same_serve_flags() -> None:
    """Every serve value a child gets from its argv equals the supervisor's own, except the
    fleet flags and the per-child consumer and metrics port."""
    argv = ["serve", "--gpus", "0,1", "--redis-url", "rediss://u:p@h:6380/2", "--cluster",
            "--ssl-ca-certs", "/ca.pem", "--ssl-no-check-hostname", "--queue", "q",
            "--partitions", "3", "--group", "g", "--stream", "a,b", "--dead-letter-stream", "d",
            "--scorer", "noop", "--noop-delay-ms", "2.5", "--max-batch-tokens", "123",
            "--max-wait-ms", "7", "--claim-idle-ms", "999", "--keep-consumer",
            "--reply-ttl-s", "0", "--drain-timeout-s", "7.5", "--max-meta-bytes", "77",
            "--max-jobs", "5", "--metrics-host", "0.0.0.0", "--metrics-port", "0",
            "--reward-token-scores", "--packing", "padded"]  # fmt: skip
    parent = _args(argv)
    specs = _children(argv, env={})
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "1"]
    for spec in specs:
        child = _args(list(spec.argv[3:]))
        skip = fleet_dests() | {"consumer"}
        mine = {k: v for k, v in vars(parent).items() if k not in skip and not k.startswith("_")}
        theirs = {k: v for k, v in vars(child).items() if k not in skip and not k.startswith("_")}
        assert theirs == mine
        assert child.consumer == f"{parent.consumer or spec.consumer[:-2]}-{spec.index}"
        assert child.replicas is None and child.gpus is None


def test_child_flags_emit_switches_and_values_that_differ() -> None:
    args = argparse.Namespace(a=1, b=True, c="x", d=None, e=False)
    defaults = {"a": 2, "b": False, "c": "x", "d": None, "e": False}
    assert child_flags(args, defaults, frozenset()) == ["--a=1", "--b"]
    assert child_flags(args, defaults, frozenset({"a"})) == ["--b"]


def test_metrics_port_zero_stays_zero_and_consumer_defaults_to_pod_name() -> None:
    argv = ["serve", "--gpus=1,3", "--metrics-port", "0"]
    specs = _children(argv, env={"POD_NAME": "w-abc"})
    assert [s.consumer for s in specs] == ["w-abc-0", "w-abc-1"]
    assert [s.metrics_port for s in specs] == [0, 0]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["1", "3"]
    assert [s.device for s in specs] == ["1", "3"]
    assert not any(a.startswith("--gpus") for a in specs[0].argv)


def test_gpus_all_uses_visible_devices_and_rejects_bad_lists() -> None:
    assert parse_gpus("all", {"CUDA_VISIBLE_DEVICES": "2,5"}) == ["2", "5"]
    assert parse_gpus(" 0, 1 ", {}) == ["0", "1"]
    with pytest.raises(ConfigError):
        parse_gpus("0,0", {})
    with pytest.raises(ConfigError):
        parse_gpus(",", {})
    with pytest.raises(ConfigError):
        _children(["serve"], env={})  # neither --gpus nor --replicas
    with pytest.raises(ConfigError):
        _children(["serve", "--replicas", "0"], env={})


def test_backoff_doubles_and_caps() -> None:
    cfg = SupervisorConfig(restart_backoff_s=0.5, restart_backoff_max_s=3.0)
    assert [cfg.backoff_s(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


# ----------------------------------------------------------------------------- real processes


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(body))
    return path


def _spec(i: int, script: Path, tmp_path: Path) -> ChildSpec:
    env = dict(os.environ, STATE_DIR=str(tmp_path), CHILD=str(i))
    return ChildSpec(i, f"c-{i}", None, None, (sys.executable, str(script)), env)


SERVING_CHILD = """
    import os, signal, sys, time
    d, i = os.environ["STATE_DIR"], os.environ["CHILD"]
    with open(os.path.join(d, f"pids-{i}"), "a") as f:
        f.write(f"{os.getpid()}\\n")
    runs = len(open(os.path.join(d, f"pids-{i}")).read().split())
    print(f"child {i} run {runs} serving", flush=True)
    if i == "0" and runs == 1:
        sys.exit(3)  # the first run of child 0 crashes
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    while not stop:
        time.sleep(0.02)
    open(os.path.join(d, f"drained-{i}-{os.getpid()}"), "w").close()
    sys.exit(0)
"""


@pytest.mark.timeout(30)
def test_crashed_child_restarts_then_sigterm_drains_all(tmp_path: Path) -> None:
    script = _script(tmp_path, SERVING_CHILD)
    out = io.StringIO()
    cfg = SupervisorConfig(restart_backoff_s=0.2, drain_timeout_s=5, poll_interval_s=0.02)
    sup = Supervisor([_spec(0, script, tmp_path), _spec(1, script, tmp_path)], cfg, output=out)

    def stop_when_restarted() -> None:
        deadline = time.monotonic() + 15
        pids = tmp_path / "pids-0"
        while time.monotonic() < deadline:
            if pids.exists() and len(pids.read_text().split()) == 2:
                time.sleep(0.3)
                break
            time.sleep(0.05)
        sup.request_stop(signal.SIGTERM)

    t = threading.Thread(target=stop_when_restarted)
    t.start()
    code = sup.run(install_signals=False)
    t.join()
    pids0 = (tmp_path / "pids-0").read_text().split()
    assert len(pids0) == 2 and pids0[0] != pids0[1], "child 0 was not restarted"
    assert len((tmp_path / "pids-1").read_text().split()) == 1, "a healthy child restarted"
    assert (tmp_path / f"drained-0-{pids0[1]}").exists()
    assert (tmp_path / f"drained-1-{(tmp_path / 'pids-1').read_text().split()[0]}").exists()
    assert code == 0
    text = out.getvalue()
    assert "[c-0] child 0 run 2 serving" in text and "[c-1] child 1 run 1 serving" in text


@pytest.mark.timeout(30)
def test_crash_loop_gives_up_and_exits_nonzero(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import os, sys
        with open(os.path.join(os.environ["STATE_DIR"], "runs"), "a") as f:
            f.write("x")
        sys.exit(7)
        """,
    )
    cfg = SupervisorConfig(
        restart_backoff_s=0.05, restart_backoff_max_s=0.1, restart_limit=3, poll_interval_s=0.02
    )
    t0 = time.monotonic()
    code = Supervisor([_spec(0, script, tmp_path)], cfg, output=io.StringIO()).run(
        install_signals=False
    )
    assert code == 1
    assert (tmp_path / "runs").read_text() == "xxxx"  # the first run + 3 restarts
    assert time.monotonic() - t0 < 10


@pytest.mark.timeout(30)
def test_exit_zero_children_are_done_and_not_restarted(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import os
        with open(os.path.join(os.environ["STATE_DIR"], "runs-" + os.environ["CHILD"]), "a") as f:
            f.write("x")
        """,
    )
    cfg = SupervisorConfig(restart_backoff_s=0.05, poll_interval_s=0.02)
    specs = [_spec(0, script, tmp_path), _spec(1, script, tmp_path)]
    assert Supervisor(specs, cfg, output=io.StringIO()).run(install_signals=False) == 0
    assert (tmp_path / "runs-0").read_text() == "x" and (tmp_path / "runs-1").read_text() == "x"


@pytest.mark.timeout(30)
def test_straggler_is_killed_after_drain_deadline(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(os.path.join(os.environ["STATE_DIR"], "up"), "w").close()
        while True:
            time.sleep(0.05)
        """,
    )
    cfg = SupervisorConfig(drain_timeout_s=0.3, drain_margin_s=0.2, poll_interval_s=0.02)
    sup = Supervisor([_spec(0, script, tmp_path)], cfg, output=io.StringIO())

    def stop_when_up() -> None:
        while not (tmp_path / "up").exists():
            time.sleep(0.02)
        sup.request_stop()

    threading.Thread(target=stop_when_up, daemon=True).start()
    t0 = time.monotonic()
    assert sup.run(install_signals=False) == 1
    assert time.monotonic() - t0 < 10
    assert sup.children[0].exit_code == -signal.SIGKILL


def test_children_never_supervise_again() -> None:
    env = {"SCORING_GPUS": "all", "SCORING_REPLICAS": "4", "SCORING_QUEUE": "q", "PATH": "/bin"}
    (spec,) = _children(["serve", "--replicas", "1"], env=env)
    assert "SCORING_GPUS" not in spec.env and "SCORING_REPLICAS" not in spec.env
    assert spec.env["SCORING_QUEUE"] == "q"
    assert spec.env["SCORING_SUPERVISED_CHILD"] == "1"
    assert not any(a.startswith(("--replicas", "--gpus")) for a in spec.argv)


def test_serve_refuses_fleet_flags_inside_a_child(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.commands.serve import flag_defaults
    from worker.processes.fleet import run_fleet

    monkeypatch.setenv("SCORING_SUPERVISED_CHILD", "1")
    assert run_fleet(_args(["serve", "--replicas", "2"]), flag_defaults()) == 2


def test_serve_flags_reach_the_supervisor_config() -> None:
    """`serve` registers the restart-policy flags, and they end up in SupervisorConfig."""
    from worker.processes.fleet import supervisor_config

    args = _args(["serve", "--scorer", "noop", "--replicas", "2", "--restart-limit", "3",
                  "--restart-backoff-s", "0.5", "--exit-on-give-up",
                  "--drain-timeout-s", "7"])  # fmt: skip
    cfg = supervisor_config(args)
    assert cfg.restart_limit == 3 and cfg.restart_backoff_s == 0.5
    assert cfg.exit_on_give_up is True and cfg.drain_timeout_s == 7
    assert supervisor_config(_args(["serve", "--replicas", "2"])).restart_limit == 10
