"""``serve --replicas N`` / ``serve --gpus all|0,1,..``: the fleet flags and the child specs.

``serve`` parses its flags once; this module turns the parsed values into one
:class:`~worker.processes.supervisor.ChildSpec` per child and a
:class:`~worker.processes.supervisor.SupervisorConfig`, and hands both to the supervisor (which
knows no ``serve`` flag). Each child gets:

* ``python -m worker serve`` with every ``serve`` flag whose parsed value differs from its default
  (its default comes from the same ``SCORING_*`` environment, which the child inherits), minus the
  fleet flags, so a child never supervises;
* ``--consumer <base>-<i>`` (base: ``--consumer``, else ``POD_NAME``, else the hostname);
* ``--metrics-port <base+i>`` (``0`` and ``-1`` stay as they are);
* ``CUDA_VISIBLE_DEVICES=<id>`` (GPU mode; ``<id>,<id>,..`` of N GPUs with ``--tensor-parallel N``:
  each child is then a group, ``worker.processes.tp_group``), else ``OMP_NUM_THREADS`` = cores / N
  unless set;
* the global ``--log-level`` / ``--log-json`` as ``SCORING_LOG_LEVEL`` / ``SCORING_LOG_JSON``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from worker.config import env_bool, env_float, env_get
from worker.errors import ConfigError
from worker.processes.supervisor import ChildSpec, SupervisorConfig, supervise

log = logging.getLogger(__name__)

#: Env that would make a child supervise again (``serve`` reads them as flag defaults).
SUPERVISOR_ENV = frozenset({"SCORING_REPLICAS", "SCORING_GPUS"})
#: Set in every child; a child that still asks for a supervisor refuses instead of forking a
#: tree of supervisors.
CHILD_MARKER_ENV = "SCORING_SUPERVISED_CHILD"
#: ``serve`` values set per child, never copied from the supervisor's own.
PER_CHILD_DESTS = frozenset({"consumer", "metrics_port"})


def add_fleet_args(parser: argparse.ArgumentParser) -> frozenset[str]:
    """Add ``--replicas``, ``--gpus`` and the restart policy flags; returns their dests."""
    g = parser.add_argument_group("supervisor (one child per GPU / replica)")
    defaults = SupervisorConfig()
    actions = [
        g.add_argument("--replicas", type=int, default=env_get("REPLICAS") or None,
                       help="run N supervised worker processes (env SCORING_REPLICAS)"),
        g.add_argument("--gpus", default=env_get("GPUS") or None,
                       help="'all' or '0,1': one worker per GPU (env SCORING_GPUS)"),
        g.add_argument("--restart-backoff-s", type=float,
                       default=env_float("RESTART_BACKOFF_S", defaults.restart_backoff_s),
                       help="first restart delay of a crashed child (doubles)"),
        g.add_argument("--restart-backoff-max-s", type=float,
                       default=env_float("RESTART_BACKOFF_MAX_S", defaults.restart_backoff_max_s),
                       help="restart delay cap"),
        g.add_argument("--restart-limit", type=int,
                       default=int(env_get("RESTART_LIMIT") or defaults.restart_limit),
                       help="crashes allowed per child within --restart-window-s"),
        g.add_argument("--restart-window-s", type=float,
                       default=env_float("RESTART_WINDOW_S", defaults.restart_window_s),
                       help="window for --restart-limit"),
        g.add_argument("--exit-on-give-up", action="store_true",
                       default=env_bool(env_get("EXIT_ON_GIVE_UP")),
                       help="drain all children and exit 1 when one child crash-loops past the "
                       "limit"),
    ]  # fmt: skip
    return frozenset(a.dest for a in actions)


def fleet_dests() -> frozenset[str]:
    """The dests of the fleet flags (what a child's argv never carries)."""
    return add_fleet_args(argparse.ArgumentParser(add_help=False))


def wants_fleet(args: argparse.Namespace) -> bool:
    """True when ``--replicas`` or ``--gpus`` asks for a supervisor."""
    return args.replicas is not None or args.gpus is not None


def supervisor_config(args: argparse.Namespace) -> SupervisorConfig:
    """The restart and drain policy of parsed ``serve`` flags."""
    return SupervisorConfig(
        restart_backoff_s=args.restart_backoff_s,
        restart_backoff_max_s=args.restart_backoff_max_s,
        restart_limit=args.restart_limit,
        restart_window_s=args.restart_window_s,
        exit_on_give_up=bool(args.exit_on_give_up),
        drain_timeout_s=args.drain_timeout_s,
    )


def parse_gpus(spec: str, env: Mapping[str, str] | None = None) -> list[str]:
    """Device ids for ``--gpus``: ``all`` enumerates, ``0,1`` (or GPU UUIDs) is taken as given.

    ``all`` honours a ``CUDA_VISIBLE_DEVICES`` already set on the supervisor (its entries are
    the ids), else counts with ``torch.cuda.device_count()``, else ``nvidia-smi -L``.
    """
    source = os.environ if env is None else env
    spec = spec.strip()
    if spec.lower() == "all":
        visible = source.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and visible.strip():
            ids = [d.strip() for d in visible.split(",") if d.strip()]
        else:
            ids = [str(i) for i in range(count_gpus())]
        if not ids:
            raise ConfigError("--gpus all: no CUDA device found (use --replicas N on CPU)")
        return ids
    ids = [d.strip() for d in spec.split(",") if d.strip()]
    if not ids:
        raise ConfigError(f"--gpus needs 'all' or a comma-separated list of ids, got {spec!r}")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"--gpus lists a device twice: {spec!r}")
    return ids


def group_gpus(ids: list[str], args: argparse.Namespace) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` of each child: one GPU each, or with ``--tensor-parallel
    N`` N disjoint GPUs each (``0,1``, ``2,3``, ...: one tensor-parallel group per child)."""
    size = int(getattr(args, "tensor_parallel", 1) or 1)
    if size <= 1:
        return ids
    if len(ids) % size:
        raise ConfigError(
            f"--gpus gives {len(ids)} GPUs ({','.join(ids)}), not a multiple of "
            f"--tensor-parallel {size}"
        )
    return [",".join(ids[i : i + size]) for i in range(0, len(ids), size)]


def count_gpus() -> int:
    """How many CUDA devices this machine has (torch, else ``nvidia-smi -L``; 0 if neither)."""
    try:
        import torch

        n = int(torch.cuda.device_count())
        if n:
            return n
    except Exception:  # torch missing or broken driver: fall back to nvidia-smi
        log.debug("torch.cuda.device_count() failed", exc_info=True)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        log.warning("nvidia-smi -L failed", exc_info=True)
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def consumer_base(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> str:
    """``--consumer``, else ``POD_NAME``, else the hostname."""
    source = os.environ if env is None else env
    return str(args.consumer or source.get("POD_NAME") or socket.gethostname())


def child_flags(
    args: argparse.Namespace, defaults: Mapping[str, Any], skip: frozenset[str]
) -> list[str]:
    """``serve`` flags for the values of ``args`` that differ from ``defaults`` (``dest`` ->
    ``--dest-with-dashes``): ``--flag=value``, or ``--flag`` for a switch that is on."""
    out: list[str] = []
    for dest, default in defaults.items():
        value = getattr(args, dest, default)
        if dest in skip or value == default:
            continue
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, bool):
            if value:
                out.append(flag)
            continue
        if isinstance(value, list):  # a repeatable flag (--cluster-node)
            out.extend(f"{flag}={item}" for item in value)
            continue
        out.append(f"{flag}={value}")
    return out


def _global_env(args: argparse.Namespace) -> dict[str, str]:
    """The global flags given before ``serve``, as the env a child reads them from."""
    env: dict[str, str] = {}
    if getattr(args, "log_level", None):
        env["SCORING_LOG_LEVEL"] = str(args.log_level)
    if getattr(args, "log_json", None) is not None:
        env["SCORING_LOG_JSON"] = "1" if args.log_json else "0"
    return env


def build_children(
    args: argparse.Namespace, defaults: Mapping[str, Any], env: Mapping[str, str] | None = None
) -> list[ChildSpec]:
    """The child specs of parsed ``serve`` flags (``--gpus`` wins over ``--replicas``);
    ``defaults`` are ``serve``'s flag defaults (dest -> value)."""
    base_env = dict(os.environ if env is None else env)
    devices: list[str | None]
    if args.gpus:
        devices = list(group_gpus(parse_gpus(str(args.gpus), base_env), args))
    elif args.replicas is not None:
        if int(args.replicas) < 1:
            raise ConfigError(f"--replicas must be >= 1, got {args.replicas}")
        devices = [None] * int(args.replicas)
    else:
        raise ConfigError("the supervisor needs --replicas N or --gpus all|0,1,..")
    flags = child_flags(args, defaults, fleet_dests() | PER_CHILD_DESTS)
    base = consumer_base(args, base_env)
    cpu_threads = max(1, (os.cpu_count() or 1) // len(devices))
    specs = []
    for i, device in enumerate(devices):
        consumer = f"{base}-{i}"
        port = None if args.metrics_port is None else int(args.metrics_port)
        if port is not None and port > 0:
            port += i  # 0 (a free port) and -1 (no endpoint) stay as they are
        argv = [sys.executable, "-m", "worker", "serve", *flags, "--consumer", consumer]
        if port is not None:
            argv += ["--metrics-port", str(port)]
        child_env = {k: v for k, v in base_env.items() if k not in SUPERVISOR_ENV}
        child_env.update(_global_env(args))
        child_env["SCORING_REPLICA_INDEX"] = str(i)
        child_env[CHILD_MARKER_ENV] = "1"
        if device is not None:
            child_env["CUDA_VISIBLE_DEVICES"] = device
        else:
            # N CPU replicas share the cores: do not let each one spawn a thread per core.
            child_env.setdefault("OMP_NUM_THREADS", str(cpu_threads))
        specs.append(ChildSpec(i, consumer, device, port, tuple(argv), child_env))
    return specs


def run_fleet(args: argparse.Namespace, defaults: Mapping[str, Any]) -> int:
    """Supervise one child per GPU / replica; the exit code (2 for a configuration error)."""
    if os.environ.get(CHILD_MARKER_ENV):
        log.error("--replicas/--gpus reached a supervised child; refusing")
        return 2
    try:
        specs = build_children(args, defaults)
        config = supervisor_config(args)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    return supervise(specs, config)
