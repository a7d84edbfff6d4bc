"""A tensor-parallel group of rank processes on this host, for the tests' two-rank scenarios,
the tensor-parallel benchmark and the GPU check's ``tp`` step (``serve --tensor-parallel N``
starts its own ranks: :mod:`worker.processes.tp_group`).

* :func:`launch`: ``python -m <module> --rank r --size N --port P --out ...`` for each rank, rank
  0 holding the ``TCPStore``; waits for all, ends the others when one fails;
* :func:`join`: what each rank calls to join the group (gloo on the CPU, NCCL on CUDA).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from worker.processes.local import free_port


def launch(
    size: int,
    module: str,
    extra: Sequence[str],
    *,
    out: Path,
    timeout_s: float = 300.0,
    device_type: str = "cpu",
    procs: list[subprocess.Popen[bytes]] | None = None,
) -> list[Path]:
    """Run ``python -m module --rank r --size N --port P --out out/rank<r>.out *extra`` for
    every rank and return the ``--out`` files, rank order, once every rank exited 0. On the CPU
    (``device_type``) each rank gets ``OMP_NUM_THREADS`` = cores / N and no CUDA; on CUDA
    rank r takes ``cuda:r``. A rank that fails, or ``timeout_s``, ends the others and raises
    with the rank's log tail. ``procs`` (a list) is filled with the ranks as they start, so a
    caller can stop them from elsewhere (a deadline)."""
    port, logs = free_port(), []
    procs = [] if procs is None else procs
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if device_type == "cpu":
        env.update(
            OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // size)), CUDA_VISIBLE_DEVICES=""
        )
    for rank in range(size):
        log = out / f"rank{rank}.log"
        logs.append(log)
        argv = [sys.executable, "-m", module, "--rank", str(rank), "--size", str(size),
                "--port", str(port), "--out", str(out / f"rank{rank}.out"), *extra]  # fmt: skip
        with open(log, "wb") as fh:
            procs.append(subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                rank = failed[0] if failed else 0
                why = f"exited with {procs[rank].returncode}" if failed else "still running"
                tail = logs[rank].read_text(errors="replace")[-3000:]
                raise RuntimeError(f"rank {rank} of {size} {why} after {timeout_s:.0f} s:\n{tail}")
            time.sleep(0.1)
        if any(p.returncode for p in procs):
            raise RuntimeError(f"a rank failed:\n{logs[0].read_text(errors='replace')[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [out / f"rank{r}.out" for r in range(size)]


def join(rank: int, size: int, port: int, device_type: str = "cpu") -> Any:
    """Join a group of ``size`` as ``rank`` on this machine (rank 0 holds the ``TCPStore``;
    gloo on the CPU, NCCL with rank r on ``cuda:r``): the group's ``Comm``."""
    import datetime

    import torch.distributed as dist

    from worker.executor.parallel.collectives import GroupSpec, init_group

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(size))
    devices = tuple(f"cuda:{r}" for r in range(size)) if device_type == "cuda" else ("cpu",) * size
    spec = GroupSpec(rank, size, "127.0.0.1", port, device_type, devices, 600.0)
    store = None
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            size,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=600),
        )
    return init_group(spec, store)


__all__ = ["join", "launch"]
