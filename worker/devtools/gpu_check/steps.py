"""The measured steps of the GPU check, one process each:
``python -m worker.devtools.gpu_check.steps NAME --json PATH --work OUT --deadline-s S
[--device cuda|cpu] [--tiny]``.

``gpu_check`` starts this per step with a time limit and reads ``PATH``. A step writes its figures
there as it goes (``StepReport.put``), so a step stopped at its limit still leaves what it had
measured, and it ends itself at ``--deadline-s`` (inside the runner's limit) with a record that
says where it was. Steps: ``env`` (versions, device, the bf16 peak of the exact variant),
``bench`` (executor vs the naive in-trainer loop: tokens/s, peak memory, MFU, agreement),
``oom`` (a capped memory forces the executor's out-of-memory split; results must equal the
uncapped run), ``backends`` (sdpa vs flex_attention vs flash_attention_2; the last two optional,
each with its own deadline), ``e2e`` (``gpu_e2e``), ``tp`` (TP=2 over NCCL against one GPU;
``tp``, skipped below two GPUs), ``tree`` (GRPO-shaped groups with prefix sharing on against
off; ``tree``). A failed check raises ``CheckFailed`` after its figures are written; a step that
cannot run here raises ``Skip``. Every file a step writes is under ``OUT``.
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
from worker.devtools.gpu_check.tp import step_tp
from worker.devtools.gpu_check.tree import step_tree
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
    """Versions, the device, its capability and memory, and its dense bf16 peak with its source."""
    report.put(**_versions(), cuda_available=torch.cuda.is_available())
    if not setup.cuda:
        report.put(device_name=f"cpu ({platform.processor() or platform.machine()})")
        report.put(cpus=os.cpu_count(), bf16_peak_tflops=None)
        return
    props = torch.cuda.get_device_properties(0)
    peak = gs.device_peak(props.name)
    report.put(
        device_name=props.name,
        capability=f"{props.major}.{props.minor}",
        total_memory_bytes=int(props.total_memory),
        multiprocessors=props.multi_processor_count,
        device_count=torch.cuda.device_count(),
        bf16_peak_tflops=None if peak is None else peak.tflops,
        bf16_peak_variant=None if peak is None else peak.variant,
        bf16_peak_source=None if peak is None else peak.source,
    )


def _peak(setup: Setup) -> gs.DevicePeak | None:
    return gs.device_peak(torch.cuda.get_device_name(0)) if setup.cuda else None


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
    report.stage("building the model")
    model = gm.build_model(shape, setup.device, dtype)
    params = gm.param_counts(model)
    flops, peak = gs.useful_flops(params, shape, counts), _peak(setup)
    peak_tflops = None if peak is None else peak.tflops
    report.put(shape=shape.as_dict(), dtype=dtype, params=params, **counts, useful_flops=flops)
    report.put(mfu_peak_tflops=peak_tflops, mfu_peak_source=None if peak is None else peak.source)
    config = ExecutorConfig(device=setup.device, dtype=dtype)  # type: ignore[arg-type]
    ex = StatelessExecutor(config, model)
    report.put(executor_config=config.__dict__, attention_backend=ex.attention_backend)
    base = torch.cuda.memory_allocated() if setup.cuda else 0
    sides: dict[str, Callable[[], list[Any]]] = {
        "executor": lambda: _logps(ex, seqs),
        "naive": lambda: gm.naive_logps(model, seqs, shape.naive_batch),
    }
    outputs, peaks = {}, {}
    report.stage("warm-up and peak memory")
    for name, fn in sides.items():  # warm-up, and the memory peak of one run each
        fn()
        peaks[name], outputs[name] = gm.measure_peak(setup.device, fn)
    report.stage("timed runs")
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


OOM_CAP_FRACTION = 0.4


def step_oom(setup: Setup, report: StepReport) -> None:
    """Cap the memory below what a big batch needs; the executor must split and still match.

    float32 weights and one padded batch of 16 sequences whose LM head covers every scored token
    in one block (``logprob_chunk_tokens`` = ``max_batch_tokens`` = 2**20 and
    ``logprob_chunk_bytes`` = 2**40, so no budget cuts it; no vocabulary tiles), checked by
    counting the head's calls. The uncapped run's extra memory is measured, then the cap allows
    the weights plus ``OOM_CAP_FRACTION`` (40%) of it, so neither the whole batch nor its halves
    fit. On CUDA the cap is the allocator's (``torch.cuda.set_per_process_memory_fraction``); on
    CPU it is simulated: the LM head raises ``torch.OutOfMemoryError`` for a block of more than
    40% of the whole batch's scored rows (the ``[rows, V]`` float32 block is what grows).
    """
    shape = gs.shape_for(setup.tiny)
    seqs = gm.ragged_inputs(shape, n=16)
    report.stage("building the model")
    model = gm.build_model(shape, setup.device, "float32")
    config = ExecutorConfig(
        device=setup.device,
        dtype="float32",
        logprob_chunk_tokens=1 << 20,
        logprob_chunk_bytes=1 << 40,
        max_batch_tokens=1 << 20,
        packing="padded",
        head_vocab_tile=0,
    )
    ex = StatelessExecutor(config, model)
    ex.score(seqs[:2])  # warm-up
    head = model.get_output_embeddings()
    blocks: list[int] = []  # rows of each LM-head call
    cap_rows: list[int] = []  # CPU: the simulated cap, in scored rows

    def count_and_cap(_module: Any, args: tuple[Any, ...]) -> None:
        rows = int(args[0].shape[0])
        blocks.append(rows)
        if cap_rows and rows > cap_rows[0]:
            raise torch.OutOfMemoryError(f"simulated: a {rows}-row head block over {cap_rows[0]}")

    hook = head.register_forward_pre_hook(count_and_cap)
    try:
        report.stage("uncapped run")
        free, base = _uncapped(setup, ex, seqs)
        scored = gm.token_counts(seqs)["scored_tokens"]
        report.put(sequences=len(seqs), scored_tokens=scored, uncapped_head_blocks=list(blocks))
        if blocks != [scored]:
            raise CheckFailed(f"the LM head ran in blocks of {blocks} rows, not one of {scored}")
        blocks.clear()
        report.stage("capped run")
        if setup.cuda:
            capped = _capped_cuda(ex, seqs, free, base, report)
        else:
            cap_rows.append(int(OOM_CAP_FRACTION * scored))
            report.put(cap="simulated", cap_rows=cap_rows[0])
            capped = ex.score(seqs)
    finally:
        hook.remove()
    errors = [str(s.error) for s in capped.scores if s.error is not None]
    diff = gm.max_abs_diff(_logps_of(free), _logps_of(capped)) if not errors else None
    report.put(
        oom_splits=capped.metrics.oom_splits,
        uncapped_oom_splits=free.metrics.oom_splits,
        capped_head_blocks=blocks,
        errors=errors[:3],
        max_abs_logp_diff=diff,
        tolerance=gs.tolerance("float32"),
    )
    if free.metrics.oom_splits or capped.metrics.oom_splits < 1:
        raise CheckFailed(
            f"expected 0 splits uncapped and >= 1 capped, got {free.metrics.oom_splits} and "
            f"{capped.metrics.oom_splits}"
        )
    if errors or diff is None or diff > gs.tolerance("float32"):
        raise CheckFailed(f"capped run differs from the uncapped one: {errors[:1] or diff}")


def _uncapped(setup: Setup, ex: StatelessExecutor, seqs: list[SequenceInput]) -> tuple[Any, int]:
    """The uncapped run and the memory allocated before it (the weights; 0 on CPU)."""
    if not setup.cuda:
        return ex.score(seqs), 0
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    return ex.score(seqs), base


def _capped_cuda(
    ex: StatelessExecutor, seqs: list[SequenceInput], free: Any, base: int, report: StepReport
) -> Any:
    """The same batch with the allocator capped at the weights + 40% of the uncapped extra."""
    extra = free.metrics.peak_allocated_bytes - base
    total = torch.cuda.get_device_properties(0).total_memory
    cap = base + int(OOM_CAP_FRACTION * extra)
    report.put(cap="allocator", model_bytes=base, uncapped_extra_bytes=extra, cap_bytes=cap)
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        capped = ex.score(seqs)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    report.put(
        capped_peak_allocated_bytes=capped.metrics.peak_allocated_bytes,
        allocated_after_bytes=torch.cuda.memory_allocated(),  # the weights again: nothing held
    )
    return capped


def _logps_of(out: Any) -> list[Any]:
    return [s.logps for s in out.scores]


def _timed_backend(
    setup: Setup, fn: Callable[[], list[Any]], tokens: int
) -> tuple[dict[str, Any], list[Any]]:
    out = fn()  # warm-up (flex compiles here)
    times = gm.best_times({"run": fn}, setup.device, repeats=1 if setup.tiny else 2)
    return {"seconds": min(times["run"]), "tokens_per_s": tokens / min(times["run"])}, out


#: seconds the backends step keeps for itself after its optional rows (its record, exit)
BACKENDS_RESERVE_S = 3.0


def step_backends(setup: Setup, report: StepReport) -> None:
    """Executor on sdpa (required) vs flash_attention_2 (when ``flash_attn`` imports) and
    flex_attention (both optional, each with a deadline of its own).

    ExecutorConfig may not accept ``flex_attention``; flex is then measured at the model level
    (the naive padded loop, sdpa vs flex on the same model) and the row says so. Every batch of
    that loop has the same shape (``width``: the longest sequence, rounded up to 128), so flex
    compiles once, not once per batch width. An optional row still running at its deadline is
    recorded as "not measured" and the step passes with the rows it has.
    """
    shape, dtype = gs.shape_for(setup.tiny), gs.dtype_for(setup.device)
    seqs = gm.ragged_inputs(shape, n=shape.sequences // 2)
    tokens = gm.token_counts(seqs)["real_tokens"]
    report.stage("building the model")
    model = gm.build_model(shape, setup.device, dtype)
    width = -(-max(len(s.tokens) for s in seqs) // 128) * 128
    report.put(sequences=len(seqs), real_tokens=tokens, dtype=dtype, model_loop_width=width)
    rows: dict[str, dict[str, Any]] = {}
    reference: list[Any] = []
    failures: list[str] = []
    optional = ["flash_attention_2", "flex_attention"]
    for backend in ["sdpa", *optional]:
        if backend == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            rows[backend] = {"status": "unavailable", "reason": "flash_attn is not importable"}
            report.put(rows=rows)
            continue
        report.stage(f"backend {backend}")
        if backend == "sdpa":
            row = _backend_row(setup, model, seqs, backend, tokens, width, reference)
        else:
            later = len(optional) - optional.index(backend)  # this row and the ones after it
            limit = (report.remaining_s() - BACKENDS_RESERVE_S) / later

            def not_measured(why: str, name: str = backend, limit: float = limit) -> None:
                rows[name] = {"status": "not measured", "reason": f"{why} ({limit:.0f} s)"}
                report.put(rows=rows)

            with report.optional(backend, limit, not_measured):
                row = _backend_row(setup, model, seqs, backend, tokens, width, reference)
        diff = row.get("max_abs_logp_diff_vs_sdpa")
        if isinstance(diff, float) and diff > gs.tolerance(dtype):
            failures.append(f"{backend} differs from sdpa by {diff:.3g}")
        rows[backend] = row
        report.put(rows=rows)
    if failures:
        raise CheckFailed("; ".join(failures))


def _backend_row(
    setup: Setup,
    model: torch.nn.Module,
    seqs: list[SequenceInput],
    backend: str,
    tokens: int,
    width: int,
    reference: list[Any],
) -> dict[str, Any]:
    """One row of the backends table; ``reference`` (sdpa's log-probs) is filled by the first."""
    dtype = gs.dtype_for(setup.device)
    try:
        config = ExecutorConfig(
            device=setup.device,
            dtype=dtype,  # type: ignore[arg-type]
            attention_backend=backend,  # type: ignore[arg-type]
        )
    except ConfigError as exc:
        return _model_level(setup, model, seqs, backend, tokens, width, str(exc))
    ex = StatelessExecutor(config, model)
    row, out = _timed_backend(setup, lambda: _logps(ex, seqs), tokens)
    ex.close()
    row.update(level="executor", used=ex.attention_backend, status="ok")
    if backend == "flex_attention":  # worker.executor.flex: never the compiled CPU kernel
        row["flex_math"] = "compiled" if setup.cuda else "eager reference"
    if ex.attention_backend != backend:
        row.update(status="fell back", reason=[e.message for e in ex.load_fallbacks][:1])
    if not reference:
        reference.extend(out)
    row["max_abs_logp_diff_vs_sdpa"] = gm.max_abs_diff(reference, out)
    return row


def _model_level(
    setup: Setup,
    model: torch.nn.Module,
    seqs: Sequence[SequenceInput],
    backend: str,
    tokens: int,
    width: int,
    why: str,
) -> dict[str, Any]:
    """sdpa vs ``backend`` through the naive padded loop on ``model`` (config restored), every
    batch padded to ``width``."""
    from worker.executor import backends

    batch = gs.shape_for(setup.tiny).naive_batch
    row: dict[str, Any] = {"level": "model (naive padded loop)", "executor_refused": why[:200]}

    def loop() -> list[Any]:
        return gm.naive_logps(model, seqs, batch, width=width)

    try:
        with backends.temporary_backend(model, "sdpa"):
            base_row, base = _timed_backend(setup, loop, tokens)
        with backends.temporary_backend(model, backend):
            got_row, got = _timed_backend(setup, loop, tokens)
    except Exception as exc:  # a backend this stack cannot run is a finding, not a crash
        row.update(status="unavailable", reason=f"{type(exc).__name__}: {exc}"[:300])
        return row
    row.update(
        status="ok",
        sdpa_tokens_per_s=base_row["tokens_per_s"],
        **got_row,
        max_abs_logp_diff_vs_sdpa=gm.max_abs_diff(base, got),
    )
    return row


STEPS: dict[str, Callable[[Setup, StepReport], None]] = {
    "env": step_env,
    "bench": step_bench,
    "oom": step_oom,
    "e2e": step_e2e,
    "tp": step_tp,
    "tree": step_tree,
    "backends": step_backends,
}


def run_step(name: str, setup: Setup, path: Path, deadline_s: float | None = None) -> int:
    """Run one step, recording its outcome in ``path``; 0 ok/skipped, 1 failed. With
    ``deadline_s`` the step ends itself then (``StepReport``)."""
    report = StepReport(path, deadline_s)
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
    parser.add_argument("--work", type=Path, required=True, help="the check's OUT folder")
    parser.add_argument("--deadline-s", type=float, default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    setup = Setup(args.device, args.tiny, args.work)
    return run_step(args.step, setup, args.json, args.deadline_s)


if __name__ == "__main__":
    sys.exit(main())
