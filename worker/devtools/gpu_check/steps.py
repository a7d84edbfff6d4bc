"""The measured steps of the GPU check, one process each:
``python -m worker.devtools.gpu_check.steps NAME --json PATH [--device cuda|cpu] [--tiny]``.

``gpu_check`` starts this per step with a time limit and reads ``PATH``. A step writes its figures
there as it goes (``StepReport.put``), so a step stopped at its limit still leaves what it had
measured. Steps: ``env`` (versions, device, bf16 peak), ``bench`` (executor vs the naive
in-trainer loop: tokens/s, peak memory, MFU, agreement), ``oom`` (a capped allocator forces the
executor's out-of-memory split; results must equal the uncapped run), ``backends`` (sdpa vs
flex_attention vs flash_attention_2), ``e2e`` (``gpu_e2e``). A failed check raises ``CheckFailed``
after its figures are written; a step that cannot run here raises ``Skip``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import platform
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from worker.devtools.gpu_check import model as gm
from worker.devtools.gpu_check import shapes as gs
from worker.devtools.gpu_check.e2e import step_e2e
from worker.devtools.gpu_check.record import CheckFailed, Setup, Skip, StepReport
from worker.errors import ConfigError
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor


def _versions() -> dict[str, Any]:
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda_runtime": torch.version.cuda,
        "flash_attn_importable": importlib.util.find_spec("flash_attn") is not None,
    }


def step_env(setup: Setup, report: StepReport) -> None:
    """Versions, the device, its capability and memory, and its dense bf16 peak."""
    report.put(**_versions(), cuda_available=torch.cuda.is_available())
    if not setup.cuda:
        report.put(device_name=f"cpu ({platform.processor() or platform.machine()})")
        report.put(cpus=os.cpu_count(), bf16_peak_tflops=None)
        return
    props = torch.cuda.get_device_properties(0)
    report.put(
        device_name=props.name,
        capability=f"{props.major}.{props.minor}",
        total_memory_bytes=int(props.total_memory),
        multiprocessors=props.multi_processor_count,
        device_count=torch.cuda.device_count(),
        bf16_peak_tflops=gs.bf16_peak_tflops(props.name),
    )


def _peak_tflops(setup: Setup) -> float | None:
    return gs.bf16_peak_tflops(torch.cuda.get_device_name(0)) if setup.cuda else None


def _logps(ex: StatelessExecutor, seqs: Sequence[SequenceInput]) -> list[Any]:
    return [s.logps for s in ex.score(seqs).scores]


def _side(
    seconds: float, peak: int | None, base: int, flops: float, peak_tflops: float | None, tok: int
) -> dict[str, Any]:
    util = gs.mfu(flops, seconds, peak_tflops)
    return {
        "seconds": seconds,
        "tokens_per_s": tok / seconds,
        "peak_allocated_bytes": peak,
        "peak_extra_bytes": None if peak is None else peak - base,
        "tflops": flops / seconds / 1e12,
        "mfu": util,
    }


def step_bench(setup: Setup, report: StepReport) -> None:
    """Executor vs the naive loop on the ragged batch: tokens/s, peak memory, MFU, agreement."""
    shape, dtype = gs.shape_for(setup.tiny), gs.dtype_for(setup.device)
    seqs = gm.ragged_inputs(shape)
    counts = gm.token_counts(seqs)
    model = gm.build_model(shape, setup.device, dtype)
    params = gm.param_counts(model)
    flops, peak_tflops = gs.useful_flops(params, shape, counts), _peak_tflops(setup)
    report.put(shape=shape.as_dict(), dtype=dtype, params=params, **counts, useful_flops=flops)
    config = ExecutorConfig(device=setup.device, dtype=dtype)  # type: ignore[arg-type]
    ex = StatelessExecutor(config, model)
    report.put(executor_config=config.__dict__, attention_backend=ex.attention_backend)
    base = torch.cuda.memory_allocated() if setup.cuda else 0
    sides: dict[str, Callable[[], list[Any]]] = {
        "executor": lambda: _logps(ex, seqs),
        "naive": lambda: gm.naive_logps(model, seqs, shape.naive_batch),
    }
    outputs, peaks = {}, {}
    for name, fn in sides.items():  # warm-up, and the memory peak of one run each
        fn()
        peaks[name], outputs[name] = gm.measure_peak(setup.device, fn)
    times = gm.best_times(sides, setup.device, repeats=1 if setup.tiny else 3)
    rows = {
        name: _side(min(ts), peaks[name], base, flops, peak_tflops, counts["real_tokens"])
        for name, ts in times.items()
    }
    diff, tol = gm.max_abs_diff(outputs["executor"], outputs["naive"]), gs.tolerance(dtype)
    speedup = rows["naive"]["seconds"] / rows["executor"]["seconds"]
    report.put(model_bytes=base, sides=rows, speedup=speedup, max_abs_logp_diff=diff, tolerance=tol)
    if not diff <= tol:
        raise CheckFailed(f"executor and naive log-probs differ by {diff:.3g} > {tol}")


def step_oom(setup: Setup, report: StepReport) -> None:
    """Cap the allocator below what a big batch needs; the executor must split and still match.

    float32 weights and one padded batch whose LM head covers every scored token at once
    (``logprob_chunk_tokens`` = ``max_batch_tokens`` = 2**20): the uncapped run's extra memory is
    measured, then the cap allows the weights plus 40% of it, so the whole batch cannot fit.
    """
    if not setup.cuda:
        raise Skip("needs CUDA (torch.cuda.set_per_process_memory_fraction)")
    shape = gs.shape_for(setup.tiny)
    seqs = gm.ragged_inputs(shape, n=16)
    model = gm.build_model(shape, setup.device, "float32")
    config = ExecutorConfig(
        device=setup.device, dtype="float32", logprob_chunk_tokens=1 << 20,
        max_batch_tokens=1 << 20, packing="padded",
    )  # fmt: skip
    ex = StatelessExecutor(config, model)
    ex.score(seqs[:2])  # warm-up
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    free = ex.score(seqs)
    extra = free.metrics.peak_allocated_bytes - base
    total = torch.cuda.get_device_properties(0).total_memory
    cap = base + int(0.4 * extra)
    report.put(sequences=len(seqs), model_bytes=base, uncapped_extra_bytes=extra, cap_bytes=cap)
    report.put(uncapped_oom_splits=free.metrics.oom_splits)
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        capped = ex.score(seqs)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    errors = [str(s.error) for s in capped.scores if s.error is not None]
    diff = gm.max_abs_diff(_logps_of(free), _logps_of(capped)) if not errors else None
    report.put(
        oom_splits=capped.metrics.oom_splits, forwards=capped.metrics.forwards,
        capped_peak_allocated_bytes=capped.metrics.peak_allocated_bytes,
        errors=errors[:3], max_abs_logp_diff=diff, tolerance=gs.tolerance("float32"),
    )  # fmt: skip
    if free.metrics.oom_splits or capped.metrics.oom_splits < 1:
        raise CheckFailed(
            f"expected 0 splits uncapped and >= 1 capped, got {free.metrics.oom_splits} and "
            f"{capped.metrics.oom_splits}"
        )
    if errors or diff is None or diff > gs.tolerance("float32"):
        raise CheckFailed(f"capped run differs from the uncapped one: {errors[:1] or diff}")


def _logps_of(out: Any) -> list[Any]:
    return [s.logps for s in out.scores]


def _timed_backend(
    setup: Setup, fn: Callable[[], list[Any]], tokens: int
) -> tuple[dict[str, Any], list[Any]]:
    out = fn()  # warm-up (flex compiles here)
    times = gm.best_times({"run": fn}, setup.device, repeats=1 if setup.tiny else 2)
    return {"seconds": min(times["run"]), "tokens_per_s": tokens / min(times["run"])}, out


def step_backends(setup: Setup, report: StepReport) -> None:
    """Executor on sdpa vs flex_attention vs flash_attention_2 (when ``flash_attn`` imports).

    ExecutorConfig may not accept ``flex_attention``; flex is then measured at the model level
    (the naive padded loop, sdpa vs flex on the same model) and the row says so.
    """
    shape, dtype = gs.shape_for(setup.tiny), gs.dtype_for(setup.device)
    seqs = gm.ragged_inputs(shape, n=shape.sequences // 2)
    tokens = gm.token_counts(seqs)["real_tokens"]
    model = gm.build_model(shape, setup.device, dtype)
    report.put(sequences=len(seqs), real_tokens=tokens, dtype=dtype)
    wanted = ["sdpa", "flash_attention_2", "flex_attention"]
    rows: dict[str, dict[str, Any]] = {}
    reference: list[Any] | None = None
    failures = []
    for backend in wanted:
        if backend == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            rows[backend] = {"status": "unavailable", "reason": "flash_attn is not importable"}
            report.put(rows=rows)
            continue
        try:
            config = ExecutorConfig(
                device=setup.device,
                dtype=dtype,  # type: ignore[arg-type]
                attention_backend=backend,  # type: ignore[arg-type]
            )
        except ConfigError as exc:
            rows[backend] = _model_level(setup, model, seqs, backend, tokens, str(exc))
            report.put(rows=rows)
            continue
        ex = StatelessExecutor(config, model)
        row, out = _timed_backend(setup, lambda ex=ex: _logps(ex, seqs), tokens)  # type: ignore[misc]
        ex.close()
        row.update(level="executor", used=ex.attention_backend, status="ok")
        if ex.attention_backend != backend:
            row.update(status="fell back", reason=[e.message for e in ex.load_fallbacks][:1])
        if reference is None:
            reference = out
        row["max_abs_logp_diff_vs_sdpa"] = gm.max_abs_diff(reference, out)
        if row["max_abs_logp_diff_vs_sdpa"] > gs.tolerance(dtype):
            failures.append(f"{backend} differs from sdpa by {row['max_abs_logp_diff_vs_sdpa']}")
        rows[backend] = row
        report.put(rows=rows)
    if failures:
        raise CheckFailed("; ".join(failures))


def _model_level(
    setup: Setup,
    model: torch.nn.Module,
    seqs: Sequence[SequenceInput],
    backend: str,
    tokens: int,
    why: str,
) -> dict[str, Any]:
    """sdpa vs ``backend`` through the naive padded loop on ``model`` (config restored)."""
    from worker.executor import backends

    batch = gs.shape_for(setup.tiny).naive_batch
    row: dict[str, Any] = {"level": "model (naive padded loop)", "executor_refused": why[:200]}
    try:
        with backends.temporary_backend(model, "sdpa"):
            base_row, base = _timed_backend(
                setup, lambda: gm.naive_logps(model, seqs, batch), tokens
            )
        with backends.temporary_backend(model, backend):
            got_row, got = _timed_backend(setup, lambda: gm.naive_logps(model, seqs, batch), tokens)
    except Exception as exc:  # a backend this stack cannot run is a finding, not a crash
        row.update(status="unavailable", reason=f"{type(exc).__name__}: {exc}"[:300])
        return row
    row.update(
        status="ok", sdpa_tokens_per_s=base_row["tokens_per_s"], **got_row,
        max_abs_logp_diff_vs_sdpa=gm.max_abs_diff(base, got),
    )  # fmt: skip
    return row


STEPS: dict[str, Callable[[Setup, StepReport], None]] = {
    "env": step_env,
    "bench": step_bench,
    "oom": step_oom,
    "e2e": step_e2e,
    "backends": step_backends,
}


def run_step(name: str, setup: Setup, path: Path) -> int:
    """Run one step, recording its outcome in ``path``; 0 ok/skipped, 1 failed."""
    report = StepReport(path)
    try:
        STEPS[name](setup, report)
    except Skip as exc:
        report.finish("skipped", reason=str(exc))
        return 0
    except Exception as exc:
        report.finish(
            "failed",
            error=f"{type(exc).__name__}: {exc}"[:1000],
            traceback_tail=traceback.format_exc()[-3000:],
        )
        traceback.print_exc()
        return 1
    report.finish("ok")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run the named step."""
    parser = argparse.ArgumentParser(prog="worker.devtools.gpu_check.steps")
    parser.add_argument("step", choices=sorted(STEPS))
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    return run_step(args.step, Setup(args.device, args.tiny), args.json)


if __name__ == "__main__":
    sys.exit(main())
