"""The GPU check's tensor-parallel step: a model sharded over two GPUs (TP=2 over NCCL) against
the same model on one GPU.

Needs two GPUs: with fewer the step is skipped, and the report says why. With ``--device cpu
--tiny`` the same runs over gloo on two CPU ranks (what the check's own tests exercise).

1. ``shapes.tp_shape`` (the benchmark's Llama with 2 layers at half its width, the vocabulary
   kept at 128,256 so the vocabulary-parallel LM head folds a real vocabulary; ``TINY`` with
   ``--tiny``) is built with random weights on the first device in the device's dtype and scored
   in process by a ``StatelessExecutor``: the reference log-probs, seconds and peak memory.
   It is saved under ``OUT/scratch/tp-model`` and freed.
2. Two ranks, the step's own process (rank 0: torch, transformers and the device are up
   already) and ``python -m worker.devtools.gpu_check.tp --rank 1 ...`` (on the CPU a fork of
   the step's process), join a group (NCCL, rank r on ``cuda:r``; gloo on the CPU), load the
   checkpoint sharded (``ParallelExecutor.load``) and score the same sequences twice through
   the leader's ``GroupScorer`` (a warm-up, then the timed call).
3. Figures: max |Δlogp| against one device (at most ``shapes.tolerance(dtype)``, else the step
   fails), tokens/s of the group and of one device, each rank's peak allocated memory beside the
   one device's, and the seconds in the group's own collectives. A rank that fails, or that is
   still running ``RESERVE_S`` before the step's deadline, fails the step with its log tail.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from worker.devtools.gpu_check import model as gm
from worker.devtools.gpu_check import shapes as gs
from worker.devtools.gpu_check.record import CheckFailed, Setup, Skip, StepReport

RANKS = 2
RESERVE_S = 4.0  # seconds of the step's deadline kept to record what the ranks did


def step_tp(setup: Setup, report: StepReport) -> None:
    """TP=2 against one device (module docstring)."""
    from worker.executor import ExecutorConfig, StatelessExecutor

    gpus = torch.cuda.device_count() if setup.cuda else 0
    if setup.cuda and gpus < RANKS:
        raise Skip(f"TP=2 over NCCL needs two GPUs; this machine has {gpus} (not run)")
    shape, dtype = gs.tp_shape(setup.tiny), gs.dtype_for(setup.device)
    seqs = gm.ragged_inputs(shape)
    counts = gm.token_counts(seqs)
    backend = "nccl" if setup.cuda else "gloo"
    report.put(shape=shape.as_dict(), dtype=dtype, ranks=RANKS, backend=backend, **counts)
    report.stage("one device: build, score, save")
    model = gm.build_model(shape, "cuda:0" if setup.cuda else "cpu", dtype)
    ex = StatelessExecutor(ExecutorConfig(device=setup.device, dtype=dtype), model)  # type: ignore[arg-type]
    ex.score(seqs)  # warm-up
    t0 = time.perf_counter()
    peak, out = gm.measure_peak(setup.device, partial(ex.score, seqs))
    one_s = time.perf_counter() - t0
    want = [s.logps for s in out.scores]
    where = setup.scratch / "tp-model"
    model.save_pretrained(where)
    ex.close()
    del ex, model, out
    gc.collect()
    if setup.cuda:
        torch.cuda.empty_cache()
    report.put(
        one_device={
            "seconds": one_s,
            "tokens_per_s": counts["real_tokens"] / one_s,
            "peak_allocated_bytes": peak,
        }
    )
    report.stage(f"two ranks over {backend}")
    mine, theirs = _two_ranks(setup, report, where, dtype)
    shutil.rmtree(where, ignore_errors=True)
    diff = gm.max_abs_diff(want, mine["logps"])
    group_s = mine["seconds"]
    report.put(
        group={
            "seconds": group_s,
            "tokens_per_s": counts["real_tokens"] / group_s,
            "rank_peak_allocated_bytes": [mine["peak"], theirs["peak"]],
            "collective_s": mine["collective_s"],
        },
        max_abs_logp_diff=diff,
        tolerance=gs.tolerance(dtype),
    )
    if not diff <= gs.tolerance(dtype):
        raise CheckFailed(f"TP=2 log-probs differ from one device by {diff:.3g}")


def _two_ranks(
    setup: Setup, report: StepReport, model: Path, dtype: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rank 0 here (torch, transformers and the device are up already) and rank 1 beside it:
    on CUDA a fresh process (``python -m worker.devtools.gpu_check.tp --rank 1 ...``: CUDA does
    not survive a fork), on the CPU a fork of this process (no second start of torch); each
    rank's record. Rank 1 exiting non-zero fails the step at once with its log tail; rank 1
    still running ``RESERVE_S`` before the deadline is killed and fails it."""
    from worker.processes.local import free_port

    work = setup.scratch / "tp"
    work.mkdir(parents=True, exist_ok=True)
    port, log, out = free_port(), work / "rank1.log", work / "rank1.json"
    rank1 = _start_rank1(setup, port, str(model), dtype, log, out)
    report.on_deadline(rank1.kill)
    done = threading.Event()

    def watch() -> None:  # rank 0 may be blocked in a collective that rank 1 never joins
        code = rank1.wait(None)
        if code and not done.is_set():
            tail = log.read_text(errors="replace")[-2000:]
            report.finish("failed", error=f"rank 1 exited with {code}: {tail}")
            os._exit(1)

    threading.Thread(target=watch, name="rank-1", daemon=True).start()
    mine = run_rank(0, RANKS, port, str(model), setup.device, dtype, setup.tiny)
    try:
        code = rank1.wait(max(1.0, report.remaining_s() - RESERVE_S))
    finally:
        done.set()
    if code is None:
        rank1.kill()
        raise CheckFailed(f"rank 1 still running: {log.read_text(errors='replace')[-2000:]}")
    if code:
        raise CheckFailed(f"rank 1 exited with {code}: {log.read_text(errors='replace')[-2000:]}")
    return mine, json.loads(out.read_text())


class _Rank1:
    """Rank 1 as a ``subprocess.Popen`` or a forked ``multiprocessing.Process``: ``kill`` and
    ``wait(timeout)``, the exit code or ``None`` while it runs.

    One thread of its own waits for the process and every ``wait`` reads what it saw: two
    threads waiting on a forked ``Process`` race for its exit status, and the loser's
    ``waitpid`` fails (ECHILD), which ``multiprocessing`` reads as "still running"."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc
        self._code: int | None = None
        self._exited = threading.Event()
        threading.Thread(target=self._reap, name="rank-1-reaper", daemon=True).start()

    def _reap(self) -> None:
        if isinstance(self.proc, subprocess.Popen):
            code = self.proc.wait()
        else:
            self.proc.join()
            code = self.proc.exitcode
        self._code = -1 if code is None else int(code)
        self._exited.set()

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()

    def wait(self, timeout: float | None) -> int | None:
        if not self._exited.wait(timeout):
            return None
        return self._code


def _start_rank1(setup: Setup, port: int, model: str, dtype: str, log: Path, out: Path) -> _Rank1:
    if setup.cuda:
        argv = [sys.executable, "-m", "worker.devtools.gpu_check.tp", "--rank", "1", "--size",
                str(RANKS), "--port", str(port), "--out", str(out), "--model", model,
                "--device", setup.device, "--dtype", dtype]  # fmt: skip
        argv += ["--tiny"] if setup.tiny else []
        with open(log, "wb") as fh:
            return _Rank1(subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // RANKS))  # both ranks share the cores
    args = (port, model, dtype, setup.tiny, str(log), str(out))
    child = multiprocessing.get_context("fork").Process(target=_forked_rank1, args=args)
    child.start()
    return _Rank1(child)


def _forked_rank1(port: int, model: str, dtype: str, tiny: bool, log: str, out: str) -> None:
    """Rank 1 in a fork of the step's process (CPU): output to ``log``, record to ``out``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    doc = run_rank(1, RANKS, port, model, "cpu", dtype, tiny)
    Path(out).write_text(json.dumps(doc))
    _exit_now()


def _exit_now() -> None:
    """End a rank once its record is written: gloo's threads are not joined at interpreter exit
    (its static destructors may then abort, exit -6), and a fork's exit joins every non-daemon
    thread first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_rank(
    rank: int, size: int, port: int, model: str, device: str, dtype: str, tiny: bool
) -> dict[str, Any]:
    """One rank: join the group, load the shards, score the sequences twice; what it saw."""
    import transformers

    from worker.devtools.bench.tensor_parallel import serve_calls
    from worker.executor import ExecutorConfig
    from worker.executor.parallel.executor import ParallelExecutor
    from worker.executor.parallel.plan import tensor_parallel_plan
    from worker.processes.tp_local import join
    from worker.request import ScoreRequest
    from worker.scorer import DEFAULT_OPTIONS

    cuda = device.startswith("cuda")
    comm = join(rank, size, port, "cuda" if cuda else "cpu")
    plan = tensor_parallel_plan(transformers.AutoConfig.from_pretrained(model), size)
    config = ExecutorConfig(device=comm.spec.device, dtype=dtype)  # type: ignore[arg-type]
    ex = ParallelExecutor.load(config, comm, [plan], reference_model=model)
    call = ScoreRequest(gm.ragged_inputs(gs.tp_shape(tiny)), None, None, DEFAULT_OPTIONS)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    warm, timed = serve_calls(ex, comm, [call, call])
    group = timed.metrics.group
    doc = {
        "rank": rank,
        "seconds": timed.metrics.elapsed_s,
        "peak": int(torch.cuda.max_memory_allocated())
        if cuda
        else warm.metrics.peak_allocated_bytes,
        "collective_s": None if group is None else group.collective_s,
        "logps": [s.logps.tolist() for s in timed.scores] if rank == 0 else None,
    }
    comm.close()
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    """One rank of the step (what ``launch`` starts)."""
    parser = argparse.ArgumentParser(prog="worker.devtools.gpu_check.tp")
    for flag in ("--rank", "--size", "--port"):
        parser.add_argument(flag, type=int, required=True)
    for flag in ("--out", "--model", "--device", "--dtype"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    doc = run_rank(args.rank, args.size, args.port, args.model, args.device, args.dtype, args.tiny)
    Path(args.out).write_text(json.dumps(doc))
    _exit_now()
    return 0  # pragma: no cover - _exit_now does not return


if __name__ == "__main__":
    sys.exit(main())
