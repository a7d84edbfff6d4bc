"""``serve --tensor-parallel N``: one worker as a group of N processes, one per device.

The process that runs ``serve`` is rank 0, the leader: it checks what the group cannot serve
(``check_tp_group``: ``error: ...``, exit 2, before any rank starts), opens the rendezvous (a
``TCPStore`` on a free port of 127.0.0.1), starts ranks 1..N-1 as ``python -m worker serve``
with the same flags and ``SCORING_TP_RANK`` / ``SCORING_TP_STORE`` / ``SCORING_TP_HEARTBEAT_FD``
in their environment (``start_leader``), and then serves as any worker does, with the group's
scorer (``worker.executor.parallel.group``). A follower (``run_follower``) joins, loads its
shards and runs what the leader broadcasts; it never opens Redis nor a port.

Rank ``r`` runs on ``cuda:r`` of the ``CUDA_VISIBLE_DEVICES`` it inherits (``--gpus all
--tensor-parallel N`` gives each supervised group its own N GPUs), or on the CPU with
``OMP_NUM_THREADS`` / N threads (``--device cpu``; CUDA is hidden from every rank).

Faults take the whole group down fast, so the leader's batch in flight is never acked (it is
reclaimed after ``--claim-idle-ms``) and the supervisor, or Kubernetes, starts a new group:

======================================  =================================================
what                                    who notices, how fast
======================================  =================================================
a follower dies (kill -9, a crash)      the leader: its channel closes, its process exits
                                        (``TpGroupWatch``, within ``POLL_S``)
the leader dies                         every follower: ``PR_SET_PDEATHSIG`` (SIGKILL), and
                                        its channel closes
a rank stops (SIGSTOP, a frozen host)   the others: no heartbeat for ``HEARTBEAT_TIMEOUT_S``
a rank hangs inside one batch           itself: its ``StepClock`` past
                                        ``--tensor-parallel-timeout-s``
a collective fails (a peer gone)        that rank (``Comm.fatal``), at once
an error on some ranks only             all ranks: the vote after each forward
======================================  =================================================

A rank that takes the group down exits with ``GROUP_FAULT_EXIT`` (75); the leader kills the
followers first. SIGTERM goes to the leader, which drains as any worker, then stops the
followers (a broadcast of ``None``); followers ignore SIGTERM and SIGINT themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from worker.errors import ConfigError
from worker.processes.fleet import _global_env, child_flags, fleet_dests
from worker.processes.parent_death import set_pdeathsig_kill

log = logging.getLogger(__name__)

RANK_ENV = "SCORING_TP_RANK"
STORE_ENV = "SCORING_TP_STORE"
FD_ENV = "SCORING_TP_HEARTBEAT_FD"
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0
POLL_S = 0.25
GROUP_FAULT_EXIT = 75
"""Exit code of a rank that takes its group down (``collectives.GROUP_FAULT_EXIT``)."""
STOP_WAIT_S = 30.0
"""How long the leader waits for the followers to leave after the last broadcast."""
PG_TIMEOUT_S = 1800.0
"""Timeout of the group's collectives (loading included); liveness is the watch's job."""


def tp_size(args: argparse.Namespace) -> int:
    """``--tensor-parallel`` (1: an ordinary single-process worker); ``ConfigError`` below 1."""
    size = int(getattr(args, "tensor_parallel", 1))
    if size < 1:
        raise ConfigError(
            f"--tensor-parallel (env SCORING_TENSOR_PARALLEL) must be >= 1, got {size}"
        )
    return size


def is_follower(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is rank 1..N-1 of a group (started by a leader)."""
    return bool((os.environ if env is None else env).get(RANK_ENV))


# ----------------------------------------------------------------------------- refusals


def _config_of(name: str, trust_remote_code: bool) -> Any:
    import transformers

    from worker.executor.weights.source import offline

    try:
        return transformers.AutoConfig.from_pretrained(
            name,
            trust_remote_code=trust_remote_code,
            local_files_only=offline() or os.path.isdir(name),
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot read the config of {name!r}: {exc}") from exc


def check_tp_group(args: argparse.Namespace) -> list[Any]:
    """What a group of ``--tensor-parallel N`` cannot serve, refused before any rank starts
    (``ConfigError``); else the plan of each named model (``plan.tensor_parallel_plan``)."""
    from worker.executor.parallel.plan import device_check, tensor_parallel_plan

    size = tp_size(args)
    flag = f"--tensor-parallel {size}"
    if args.scorer == "noop":
        raise ConfigError(f"{flag} shards a model; --scorer noop has none")
    if getattr(args, "adapter_root", None) or getattr(args, "model_root", None):
        raise ConfigError(
            f"{flag}: per-job adapters and versions (--adapter-root, --model-root) are not "
            "served under tensor parallelism yet",
            hint="serve them with one process per device, or drop the roots",
        )
    names = [n for n in (args.reference_model, args.reward_model) if n]
    if args.gguf_file or args.reward_gguf_file or any(n.endswith(".gguf") for n in names):
        raise ConfigError(f"{flag}: GGUF checkpoints are not loaded sharded; use safetensors")
    if args.reward_adapter:
        raise ConfigError(
            f"{flag}: --reward-adapter runs code that reads the sharded model in ways the "
            "group cannot check; the checkpoint's own head (--reward-head) is served"
        )
    if args.reward_model and args.reward_head == "lm-label":
        raise ConfigError(
            f"{flag}: an LM-label process reward model reads the LM head's "
            "logits directly; it is not served sharded yet"
        )
    plans = [
        tensor_parallel_plan(_config_of(n, args.trust_remote_code), size, name=n) for n in names
    ]
    visible = _visible_gpus() if args.device != "cpu" else []
    device_check(size, args.device, len(visible), os.cpu_count() or 1)
    return plans


def _visible_gpus() -> list[str]:
    """The GPU ids this process sees (``CUDA_VISIBLE_DEVICES``, else torch's count)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


# ----------------------------------------------------------------------------- the watch


class TpGroupWatch:
    """One thread per rank that takes the group down on a fault (module table): it sends a
    heartbeat byte to each peer every ``HEARTBEAT_INTERVAL_S``, reads theirs, polls the
    followers' processes (leader) and this rank's ``StepClock``.

    ``on_fault(reason, code)`` must not return (it ends the process)."""

    def __init__(
        self,
        rank: int,
        peers: dict[int, socket.socket],
        clock: Any,
        step_timeout_s: float,
        on_fault: Callable[[str, int], NoReturn],
        procs: dict[int, subprocess.Popen[bytes]] | None = None,
    ) -> None:
        self.rank, self.peers, self.clock = rank, peers, clock
        self.step_timeout_s = step_timeout_s
        self.on_fault = on_fault
        self.procs = procs or {}
        self._stop = threading.Event()
        for sock in peers.values():
            sock.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="tp-watch", daemon=True)

    def start(self) -> TpGroupWatch:
        """Start watching."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (a clean stop: peers leaving are no fault any more)."""
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        with contextlib.suppress(SystemExit):  # a fault handler that ends only this thread
            self._watch()

    def _watch(self) -> None:
        seen = dict.fromkeys(self.peers, time.monotonic())
        next_beat = 0.0
        by_sock = {s.fileno(): r for r, s in self.peers.items()}
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_INTERVAL_S
                for sock in self.peers.values():
                    with contextlib.suppress(BlockingIOError, OSError):
                        sock.send(b".")
            ready, _, _ = select.select(list(self.peers.values()), [], [], POLL_S)
            if self._stop.is_set():
                return
            now = time.monotonic()
            for sock in ready:
                peer = by_sock[sock.fileno()]
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                except ConnectionResetError:  # it closed with our heartbeats unread: it exited
                    data = b""
                except OSError as exc:
                    self._fault(f"rank {peer}'s channel failed: {exc}", peer)
                if not data:
                    self._fault(f"rank {peer} closed its channel (it exited)", peer)
                seen[peer] = now
            for peer, proc in self.procs.items():
                code = proc.poll()
                if code is not None:
                    self._fault(f"rank {peer} exited with {code}", peer, code)
            for peer, at in seen.items():
                if now - at > HEARTBEAT_TIMEOUT_S:
                    self._fault(
                        f"rank {peer} sent no heartbeat for {now - at:.0f} s (stopped or hung)",
                        peer,
                    )
            busy, limit = self.clock.busy_for(), self.step_timeout_s
            if busy is not None and busy > limit:
                why = f"over --tensor-parallel-timeout-s {limit:g}"
                self._fault(f"rank {self.rank} has spent {busy:.0f} s in one batch ({why})", 0)

    def _fault(self, reason: str, peer: int, code: int | None = None) -> NoReturn:
        if self._stop.is_set():  # a clean stop raced the check
            raise SystemExit(0)
        proc = self.procs.get(peer)
        if code is None and proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(0.5)  # name the exit code when the process is gone
        self.on_fault(reason, 2 if code == 2 else GROUP_FAULT_EXIT)


def _die(procs: Mapping[int, subprocess.Popen[bytes]]) -> Callable[[str, int], NoReturn]:
    def on_fault(reason: str, code: int) -> NoReturn:
        log.error("tensor-parallel group fault: %s; taking the group down", reason)
        for proc in procs.values():
            with contextlib.suppress(OSError):
                proc.kill()
        logging.shutdown()
        os._exit(code)

    return on_fault


# ----------------------------------------------------------------------------- ranks


def _devices(size: int, device: str) -> tuple[str, tuple[str, ...]]:
    """The device type of the group and every rank's device as shown in ``info``."""
    if device == "cpu" or not _visible_gpus():
        return "cpu", ("cpu",) * size
    visible = _visible_gpus()
    return "cuda", tuple(f"cuda:{r} (GPU {visible[r]})" for r in range(size))


def _threads(size: int) -> int:
    """CPU threads per rank: the process's share (``OMP_NUM_THREADS``, else the cores) / N."""
    raw = os.environ.get("OMP_NUM_THREADS", "")
    total = int(raw) if raw.isdigit() and int(raw) > 0 else os.cpu_count() or 1
    return max(1, total // size)


@dataclass
class Leader:
    """Rank 0's side of a started group: the collectives, the step clock, the plans, the
    followers and the watch; ``close`` after serving, ``abort`` on a failure."""

    comm: Any
    clock: Any
    plans: list[Any]
    procs: dict[int, subprocess.Popen[bytes]]
    watch: TpGroupWatch
    scorer: Any = None
    sockets: list[socket.socket] = field(default_factory=list)

    def close(self) -> None:
        """Stop the followers after the leader drained: broadcast the stop, wait, free."""
        self.watch.stop()
        if self.scorer is not None:
            self.scorer.close()
        deadline = time.monotonic() + STOP_WAIT_S
        for rank, proc in self.procs.items():
            try:
                code = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("rank %d did not stop in %.0f s: SIGKILL", rank, STOP_WAIT_S)
                proc.kill()
                code = proc.wait()
            log.info("rank %d stopped (exit %s)", rank, code)
        self.comm.close()

    def abort(self) -> None:
        """Kill the followers (the leader failed before or while serving)."""
        self.watch.stop()
        for proc in self.procs.values():
            with contextlib.suppress(OSError):
                proc.kill()


def start_leader(args: argparse.Namespace, defaults: Mapping[str, Any]) -> Leader:
    """Refuse what cannot work, start ranks 1..N-1, join the group as rank 0 (module
    docstring). ``defaults``: ``serve``'s flag defaults (the followers get every flag that
    differs from them)."""
    import datetime

    import torch
    import torch.distributed as dist

    from worker.executor.parallel.collectives import GroupSpec, init_group
    from worker.executor.parallel.group import StepClock

    plans = check_tp_group(args)
    size = tp_size(args)
    device_type, devices = _devices(size, args.device)
    threads = _threads(size)
    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE=str(size))
    if device_type == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before CUDA starts: every rank on the CPU
        torch.set_num_threads(threads)
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    argv = [sys.executable, "-m", "worker", "serve", *child_flags(args, defaults, fleet_dests())]
    procs: dict[int, subprocess.Popen[bytes]] = {}
    peers: dict[int, socket.socket] = {}
    for rank in range(1, size):
        mine, theirs = socket.socketpair()
        env = {**os.environ, **_global_env(args), RANK_ENV: str(rank),
               STORE_ENV: f"127.0.0.1:{store.port}", FD_ENV: str(theirs.fileno()),
               "LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(size)}  # fmt: skip
        if device_type == "cpu":
            env["OMP_NUM_THREADS"] = str(threads)
        procs[rank] = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),),
            preexec_fn=set_pdeathsig_kill if sys.platform.startswith("linux") else None,
        )
        theirs.close()
        peers[rank] = mine
        log.info("rank %d of %d started: pid %d, %s", rank, size, procs[rank].pid, devices[rank])
    clock = StepClock()
    watch = TpGroupWatch(0, peers, clock, args.tensor_parallel_timeout_s, _die(procs), procs)
    watch.start()
    spec = GroupSpec(0, size, "127.0.0.1", store.port, device_type, devices, PG_TIMEOUT_S)
    try:
        comm = init_group(spec, store)
    except Exception:
        for proc in procs.values():
            proc.kill()
        raise
    log.info("tensor-parallel group of %d joined: %s", size, ", ".join(devices))
    return Leader(comm, clock, plans, procs, watch, sockets=list(peers.values()))


def run_follower(args: argparse.Namespace, load: Callable[[Any, list[Any]], Any]) -> int:
    """Rank 1..N-1: join the group, load the shards (``load(comm, plans)``: the same
    ``ParallelExecutor`` the leader builds), run the leader's calls until it stops the group."""
    import torch

    from worker.executor.parallel.collectives import GroupSpec, init_group
    from worker.executor.parallel.group import StepClock, follow

    rank = int(os.environ[RANK_ENV])
    host, _, port = os.environ[STORE_ENV].rpartition(":")
    _tag_logs(rank)
    for sig in (signal.SIGTERM, signal.SIGINT):  # the leader drains; it stops the followers
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=int(os.environ[FD_ENV]))
    clock = StepClock()
    watch = TpGroupWatch(rank, {0: sock}, clock, args.tensor_parallel_timeout_s, _die({}))
    watch.start()
    size = tp_size(args)
    device_type, devices = _devices(size, args.device)
    if device_type == "cpu":
        torch.set_num_threads(_threads(1))  # OMP_NUM_THREADS is already this rank's share
    plans = check_tp_group(args)
    comm = init_group(GroupSpec(rank, size, host, int(port), device_type, devices, PG_TIMEOUT_S))
    executor = load(comm, plans)
    log.info("rank %d of %d ready on %s", rank, size, devices[rank])
    follow(executor, comm, clock)
    watch.stop()
    comm.close()
    return 0


def _tag_logs(rank: int) -> None:
    """Prefix this process's log lines with its rank (they share the leader's stderr)."""

    class Tag(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            record.msg = f"[rank {rank}] {record.msg}"
            return True

    for handler in logging.getLogger().handlers:
        handler.addFilter(Tag())
