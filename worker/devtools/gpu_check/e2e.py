"""The GPU check's end-to-end step: an embedded Valkey, one ``python -m worker serve`` subprocess
on the check's device, jobs submitted with ``ScoringClient``; every job must be answered with the
log-probs an in-process ``StatelessExecutor`` computes from the same saved model.

1. The benchmark's Llama shape with 2 layers (vocab kept: the LM head is most of a scoring pass)
   is saved with ``save_pretrained`` to a temporary directory, in the device's dtype.
2. The worker subprocess loads it (``--device``, ``--dtype``); meanwhile this process scores every
   job in process, one ``score`` call per job.
3. One untimed job waits out the worker's start; then every job goes through ``score_many``
   (64 in flight) and the clock runs from the first submit to the last result: jobs/s, tokens/s.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from worker.devtools.gpu_check import model as gm
from worker.devtools.gpu_check import shapes as gs
from worker.devtools.gpu_check.record import CheckFailed, Setup, StepReport

SEQS_PER_JOB = 4
MAX_BATCH_TOKENS = 16384
START_TIMEOUT_S = 180.0


def _jobs(shape: gs.Shape) -> list[list[dict[str, Any]]]:
    """The ragged sequences grouped ``SEQS_PER_JOB`` to a job, as client dicts."""
    seqs = gm.ragged_inputs(shape)
    flat = [
        {"tokens": np.asarray(s.tokens).tolist(), "prompt_len": int(s.prompt_len or 1)}
        for s in seqs
    ]
    return [flat[i : i + SEQS_PER_JOB] for i in range(0, len(flat), SEQS_PER_JOB)]


def _serve_argv(url: str, queue: str, model_dir: Path, device: str, dtype: str) -> list[str]:
    return [
        sys.executable, "-m", "worker", "--log-level", "WARNING", "serve",
        "--redis-url", url, "--queue", queue, "--reference-model", str(model_dir),
        "--device", device, "--dtype", dtype, "--consumer", "gpu-check",
        "--max-batch-tokens", str(MAX_BATCH_TOKENS), "--metrics-port", "-1",
    ]  # fmt: skip


def _in_process(model_dir: Path, device: str, dtype: str, jobs: list[Any]) -> list[list[Any]]:
    """Each job scored alone by an executor on the same saved model."""
    from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor

    config = ExecutorConfig(
        device=device,
        dtype=dtype,  # type: ignore[arg-type]
        max_batch_tokens=MAX_BATCH_TOKENS,
    )
    ex = StatelessExecutor.from_pretrained(config, reference_model=str(model_dir))
    out = []
    for job in jobs:
        seqs = [SequenceInput(s["tokens"], prompt_len=s["prompt_len"]) for s in job]
        out.append([s.logps for s in ex.score(seqs).scores])
    ex.close()
    return out


def _stop(proc: subprocess.Popen[bytes]) -> int | None:
    """SIGTERM the worker, then SIGKILL after 30 s; its exit code."""
    proc.terminate()
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


def _tail(path: Path, limit: int = 2000) -> str:
    return path.read_text(errors="replace")[-limit:] if path.exists() else ""


def step_e2e(setup: Setup, report: StepReport) -> None:
    """Run the end-to-end check (see the module docstring); raises ``CheckFailed`` on a miss."""
    import torch

    from worker.client import ScoringClient
    from worker.devtools.embedded import EmbeddedRedis

    shape, dtype = gs.e2e_shape(setup.tiny), gs.dtype_for(setup.device)
    jobs = _jobs(shape)
    tokens = sum(len(s["tokens"]) for job in jobs for s in job)
    report.put(shape=shape.as_dict(), dtype=dtype, jobs=len(jobs), real_tokens=tokens)
    with tempfile.TemporaryDirectory(prefix="gpu-check-e2e-") as tmp:
        model_dir, log_path = Path(tmp) / "model", Path(tmp) / "worker.log"
        model = gm.build_model(shape, setup.device, dtype)
        model.save_pretrained(model_dir)
        del model
        if setup.cuda:
            torch.cuda.empty_cache()
        queue = f"gpucheck{os.getpid()}"
        with EmbeddedRedis() as server, open(log_path, "wb") as log:
            proc = subprocess.Popen(
                _serve_argv(server.url, queue, model_dir, setup.device, dtype),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            try:
                expected = _in_process(model_dir, setup.device, dtype, jobs)
                with ScoringClient(server.url, queue=queue) as client:
                    t0 = time.perf_counter()
                    client.score(jobs[0], timeout=START_TIMEOUT_S)  # waits out the worker's load
                    report.put(first_job_s=time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    results = list(client.score_many(jobs, max_in_flight=64, timeout=120.0))
                    elapsed = time.perf_counter() - t0
            except Exception:
                report.put(worker_log_tail=_tail(log_path))
                raise
            finally:
                exit_code = _stop(proc)
    got = [[s.logps for s in r.seqs] for r in results if not isinstance(r, Exception)]
    report.put(answered=len(got), seconds=elapsed, jobs_per_s=len(got) / elapsed)
    report.put(tokens_per_s=tokens / elapsed, worker_exit_code=exit_code)
    if len(got) != len(jobs):
        raise CheckFailed(f"{len(got)}/{len(jobs)} jobs answered")
    diff = max(gm.max_abs_diff(a, b) for a, b in zip(expected, got, strict=True))
    tol = gs.tolerance(dtype)
    report.put(max_abs_logp_diff=diff, tolerance=tol)
    if not diff <= tol:
        raise CheckFailed(f"worker and in-process log-probs differ by {diff:.3g} > {tol}")
