"""The GPU check's end-to-end step: an embedded Valkey, one ``python -m worker serve`` subprocess
on the check's device, jobs submitted with ``ScoringClient``; every job must be answered with the
log-probs an in-process ``StatelessExecutor`` computes from the same saved model.

1. The benchmark's Llama shape with 2 layers (vocab kept: the LM head is most of a scoring pass)
   is saved with ``save_pretrained`` under ``OUT/scratch/e2e-model`` (about 1.3 GB in bf16 on the
   GPU) in the device's dtype, and removed when the step ends.
2. The worker subprocess loads it (``--device``, ``--dtype``), its log going to
   ``OUT/worker.log``; meanwhile this process scores every job in process, one ``score`` call per
   job.
3. One untimed job waits out the worker's start, polling the worker between short waits: a worker
   that exits fails the step at once with its exit code and log tail. Then every job goes
   through ``score_many`` (64 in flight) and the clock runs from the first submit to the last
   result: jobs/s, tokens/s. Every wait ends inside the step's own deadline.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from worker.devtools.gpu_check import model as gm
from worker.devtools.gpu_check import shapes as gs
from worker.devtools.gpu_check.record import CheckFailed, Setup, StepReport
from worker.processes.local import LocalWorker

SEQS_PER_JOB = 4
MAX_BATCH_TOKENS = 16384
POLL_S = 1.0  # a wait on the first result between two looks at the worker process
#: seconds of the step's deadline kept for what follows the last wait (stop the worker, record)
RESERVE_S = 12.0
STOP_GRACE_S = 8.0  # SIGTERM, then SIGKILL: the worker drains within this


def _jobs(shape: gs.Shape) -> list[list[dict[str, Any]]]:
    """The ragged sequences grouped ``SEQS_PER_JOB`` to a job, as client dicts."""
    seqs = gm.ragged_inputs(shape)
    flat = [
        {"tokens": np.asarray(s.tokens).tolist(), "prompt_len": int(s.prompt_len or 1)}
        for s in seqs
    ]
    return [flat[i : i + SEQS_PER_JOB] for i in range(0, len(flat), SEQS_PER_JOB)]


def _serve_args(url: str, queue: str, model_dir: Path, device: str, dtype: str) -> list[str]:
    return [
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


def _tail(path: Path, limit: int = 2000) -> str:
    return path.read_text(errors="replace")[-limit:] if path.exists() else ""


def _first_result(
    client: Any,
    job: list[dict[str, Any]],
    proc: subprocess.Popen[bytes],
    report: StepReport,
    log_path: Path,
) -> float:
    """Submit ``job`` and wait for its result while the worker loads: between waits of
    ``POLL_S`` the worker process is looked at, and a dead one fails the step at once. Seconds
    until the answer."""
    from worker.client import ScoringTimeout

    t0 = time.perf_counter()
    handle = client.submit(job)
    while True:
        code = proc.poll()
        if code is not None:
            raise CheckFailed(
                f"the worker exited with code {code} before answering (OUT/worker.log): "
                + _tail(log_path, 600)
            )
        left = report.remaining_s() - RESERVE_S
        if left <= 0:
            raise CheckFailed(
                f"the worker did not answer its first job in {time.perf_counter() - t0:.0f} s "
                "(the step's deadline; OUT/worker.log): " + _tail(log_path, 600)
            )
        try:
            client.result(handle, timeout=min(POLL_S, left))
            return time.perf_counter() - t0
        except ScoringTimeout:
            continue


def step_e2e(setup: Setup, report: StepReport) -> None:
    """Run the end-to-end check (see the module docstring); raises ``CheckFailed`` on a miss."""
    import torch

    from worker.client import ScoringClient
    from worker.demo.embedded import EmbeddedRedis

    shape, dtype = gs.e2e_shape(setup.tiny), gs.dtype_for(setup.device)
    jobs = _jobs(shape)
    tokens = sum(len(s["tokens"]) for job in jobs for s in job)
    report.put(shape=shape.as_dict(), dtype=dtype, jobs=len(jobs), real_tokens=tokens)
    model_dir, log_path = setup.scratch / "e2e-model", setup.work / "worker.log"
    report.put(worker_log=str(log_path))
    try:
        report.stage("saving the model")
        model = gm.build_model(shape, setup.device, dtype)
        model.save_pretrained(model_dir)
        del model
        if setup.cuda:
            torch.cuda.empty_cache()
        report.put(saved_model_bytes=sum(f.stat().st_size for f in model_dir.rglob("*")))
        queue = "gpucheck"
        with EmbeddedRedis() as server:
            worker = LocalWorker(
                _serve_args(server.url, queue, model_dir, setup.device, dtype),
                log_path=log_path,
                log_level="WARNING",
            )
            report.on_deadline(lambda: worker.stop(STOP_GRACE_S))
            try:
                report.stage("scoring in process while the worker loads")
                expected = _in_process(model_dir, setup.device, dtype, jobs)
                # a fresh server: the loading worker creates the group, so wait for it anyway
                with ScoringClient(server.url, queue=queue, wait_for_unknown_queue=True) as client:
                    report.stage("waiting for the worker's first result")
                    report.put(
                        first_job_s=_first_result(client, jobs[0], worker.proc, report, log_path)
                    )
                    report.stage("timed jobs")
                    timeout = max(1.0, report.remaining_s() - RESERVE_S)
                    t0 = time.perf_counter()
                    results = list(client.score_many(jobs, max_in_flight=64, timeout=timeout))
                    elapsed = time.perf_counter() - t0
            except Exception:
                report.put(worker_log_tail=_tail(log_path))
                raise
            finally:
                exit_code = worker.stop(STOP_GRACE_S)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)  # 1.3 GB on the GPU: not kept under OUT
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
