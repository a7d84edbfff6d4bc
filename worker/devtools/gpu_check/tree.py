"""The GPU check's tree step: GRPO-shaped group sets scored with prefix sharing on
(``prefix_sharing="auto"``: tree rows, each group's prompt through the backbone once) and off
(every sequence in full) by two executors on the same model, per attention backend and dtype.

Rows (``shapes.tree_rows``): sdpa in float32 (the reference: exact math, not timed), sdpa in
bfloat16, and flash_attention_2 in bfloat16 where ``flash_attn`` imports (else "unavailable"; an
executor that falls back to another backend at load is recorded as "fell back", not measured);
on the CPU (``--device cpu --tiny``) sdpa alone, in both dtypes. Sets (``shapes.tree_sets``):
(P, G, C) = (1024, 8, 128) and (256, 8, 512), two groups each, and a set without a shared prefix
at the token count of the first (small ones on ``TINY``).

Per row and set: the max and the largest per-sequence mean |Δlogp| tree vs per-sequence (within
``shapes.TREE_TOLERANCE`` of the dtype, else the step fails); what the executor's load check
decided (``info["prefix_sharing"]``: a row whose ``auto`` executor does not share fails, since
its comparison would be of per-sequence with itself); the tokens through the backbone of each
side (``BatchMetrics.forward_tokens`` and ``shared_prefix_tokens``: tree rows must run exactly
the set's unique tokens; a row that raises is recorded as "error" and fails the step, the
other rows still run); for bfloat16 rows the median seconds of each side over a few
interleaved runs (``torch.cuda.synchronize`` around each; as many as the step's time allows, at
most ``REPEATS``) with the speed-up, and the error of both sides against the float32 reference.
The reference row also records ``context_effect``: how far the completions' log-probs move when
a group's prompt is replaced; a tolerance not well below it could not see a wrong prefix (noted).
"""

from __future__ import annotations

import gc
import importlib.util
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal

import numpy as np
import torch

from worker.devtools.gpu_check import model as gm
from worker.devtools.gpu_check import shapes as gs
from worker.devtools.gpu_check.record import CheckFailed, Setup, StepReport
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.scorer.outputs import ScoreOutput

MODES: tuple[Literal["off", "auto"], ...] = ("off", "auto")  # per sequence, tree rows
REPEATS = 5  # timed runs per side at most (the median is reported)
RESERVE_S = 3.0  # seconds of the step's deadline kept for its record
LogProbs = list[np.ndarray]


def step_tree(setup: Setup, report: StepReport) -> None:
    """Tree rows against per-sequence rows (module docstring)."""
    shape, sets = gs.shape_for(setup.tiny), gs.tree_sets(setup.tiny)
    inputs = {s.name: gm.group_inputs(s, shape.vocab_size) for s in sets}
    tolerance = {d: {"max": m, "mean": n} for d, (m, n) in gs.TREE_TOLERANCE.items()}
    report.put(model=shape.describe_model(), sets={s.name: s.as_dict() for s in sets})
    report.put(tolerance=tolerance, max_repetitions=REPEATS)
    plan = gs.tree_rows(setup.device)
    rows: dict[str, dict[str, Any]] = {}
    reference: dict[str, LogProbs] = {}  # set -> float32 per-sequence log-probs
    failures: list[str] = []
    notes: list[str] = []
    model: Any = None
    for i, (backend, dtype) in enumerate(plan):
        key = f"{backend}/{dtype}"
        if backend == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            rows[key] = _head(backend, dtype, "unavailable", reason="flash_attn is not importable")
            report.put(rows=rows)
            continue
        report.stage(f"{key}: building the model")
        if model is None or _dtype_of(model) != dtype:
            model = None
            _free(setup)
            model = gm.build_model(shape, setup.device, dtype)
        later = sum(len(sets) for _, d in plan[i + 1 :] if d != "float32")
        row = _head(backend, dtype, "running")
        rows[key] = row
        try:
            _measure_row(setup, report, model, sets, inputs, reference, row, later, rows)
        except Exception as exc:  # the row's failure is a finding; the other rows still run
            row.update(status="error", reason=f"{type(exc).__name__}: {exc}"[:300])
            failures.append(f"{key}: {row['reason']}")
            traceback.print_exc()
        failures += _row_failures(key, row, sets)
        notes += _row_notes(key, row, sets)
        report.put(rows=rows, notes=notes)
    if failures:
        raise CheckFailed("; ".join(failures))


def _head(backend: str, dtype: str, status: str, **fields: Any) -> dict[str, Any]:
    return {"backend": backend, "dtype": dtype, "status": status, **fields}


def _dtype_of(model: torch.nn.Module) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def _free(setup: Setup) -> None:
    gc.collect()
    if setup.cuda:
        torch.cuda.empty_cache()


def _measure_row(
    setup: Setup,
    report: StepReport,
    model: torch.nn.Module,
    sets: Sequence[gs.GroupSet],
    inputs: dict[str, list[SequenceInput]],
    reference: dict[str, LogProbs],
    row: dict[str, Any],
    later: int,
    rows: dict[str, dict[str, Any]],
) -> None:
    """Fill ``row`` set by set (written after each, so a stopped step keeps what it had)."""
    backend, dtype = row["backend"], row["dtype"]
    report.stage(f"{backend}/{dtype}: loading two executors")
    executors: dict[str, StatelessExecutor] = {
        mode: StatelessExecutor(
            ExecutorConfig(
                device=setup.device,
                dtype=dtype,
                attention_backend=backend,
                prefix_sharing=mode,
            ),
            model,
        )
        for mode in MODES
    }
    try:
        info = {mode: ex.info for mode, ex in executors.items()}
        row.update(
            used={mode: i["attention_backend"] for mode, i in info.items()},
            prefix_sharing={mode: i["prefix_sharing"] for mode, i in info.items()},
            sharing_enabled=info["auto"]["prefix_sharing"] == "on",
            sets={},
        )
        fell = [e.message for ex in executors.values() for e in ex.load_fallbacks][:1]
        if any(used != backend for used in row["used"].values()):
            row.update(status="fell back", reason=fell or "another backend is active")
            return
        timed = dtype != "float32"
        for k, gset in enumerate(sets):
            report.stage(f"{backend}/{dtype}: {gset.name}")
            row["sets"][gset.name] = entry = _compare(setup, executors, inputs[gset.name])
            logps = entry.pop("_logps")
            if dtype == "float32" and backend == "sdpa":
                reference[gset.name] = logps["off"]
                if gset.shared and "context_effect" not in row:
                    row["context_effect"] = _context_effect(
                        executors["off"], gset, inputs[gset.name], logps["off"]
                    )
            elif gset.name in reference:
                entry["vs_float32"] = _against(reference[gset.name], logps)
            if timed:
                pairs_left = len(sets) - k + later
                share_s = (report.remaining_s() - RESERVE_S) / pairs_left
                entry.update(_timing(setup, executors, inputs[gset.name], entry, share_s))
            report.put(rows=rows)
        row["status"] = "ok"
    finally:
        for ex in executors.values():
            ex.close()


def _compare(
    setup: Setup, executors: dict[str, StatelessExecutor], seqs: list[SequenceInput]
) -> dict[str, Any]:
    """One run of each side (also the warm-up): agreement, backbone tokens, first seconds."""
    outs: dict[str, ScoreOutput] = {}
    first: dict[str, float] = {}
    for mode, ex in executors.items():
        gm.synchronize(setup.device)
        t0 = time.perf_counter()
        outs[mode] = ex.score(seqs)
        gm.synchronize(setup.device)
        first[mode] = time.perf_counter() - t0
    logps = {mode: [s.logps for s in out.scores] for mode, out in outs.items()}
    errors = [str(s.error) for out in outs.values() for s in out.scores if s.error is not None]
    metrics = {mode: out.metrics for mode, out in outs.items()}
    entry: dict[str, Any] = {
        "errors": errors[:3],
        "forward_tokens": {m: x.forward_tokens for m, x in metrics.items()},
        "shared_prefix_tokens": {m: x.shared_prefix_tokens for m, x in metrics.items()},
        "forwards": {m: x.forwards for m, x in metrics.items()},
        "peak_allocated_bytes": {m: x.peak_allocated_bytes for m, x in metrics.items()},
        "first_seconds": first,
        "_logps": logps,
    }
    if not errors:
        entry["max_abs_logp_diff"] = gm.max_abs_diff(logps["off"], logps["auto"])
        entry["mean_abs_logp_diff"] = gm.max_mean_abs_diff(logps["off"], logps["auto"])
    return entry


def _against(reference: LogProbs, logps: dict[str, LogProbs]) -> dict[str, float]:
    """Each side's error against the float32 per-sequence log-probs."""
    return {
        "tree_max": gm.max_abs_diff(reference, logps["auto"]),
        "tree_mean": gm.max_mean_abs_diff(reference, logps["auto"]),
        "per_sequence_max": gm.max_abs_diff(reference, logps["off"]),
        "per_sequence_mean": gm.max_mean_abs_diff(reference, logps["off"]),
    }


def _context_effect(
    ex: StatelessExecutor,
    gset: gs.GroupSet,
    seqs: list[SequenceInput],
    logps: LogProbs,
) -> float:
    """Largest |Δlogp| of the completions when each group's prompt is another random one."""
    vocab = ex.vocab_size
    rng = np.random.default_rng(gs.SEED + 1)
    other = []
    for g in range(gset.groups):
        prompt = rng.integers(0, vocab, gset.prompt_tokens)
        for s in seqs[g * gset.completions : (g + 1) * gset.completions]:
            tokens = np.concatenate([prompt, np.asarray(s.tokens)[gset.prompt_tokens :]])
            other.append(SequenceInput(tokens, prompt_len=gset.prompt_tokens))
    return gm.max_abs_diff(logps, [s.logps for s in ex.score(other).scores])


def _timing(
    setup: Setup,
    executors: dict[str, StatelessExecutor],
    seqs: list[SequenceInput],
    entry: dict[str, Any],
    share_s: float,
) -> dict[str, Any]:
    """Median seconds of each side over interleaved runs: ``REPEATS``, or as many as
    ``share_s`` holds at the first runs' pace (at least one)."""
    per_round = sum(entry["first_seconds"].values())
    repeats = max(1, min(REPEATS, int(share_s / per_round))) if per_round > 0 else REPEATS
    sides: dict[str, Callable[[], object]] = {
        mode: partial(ex.score, seqs) for mode, ex in executors.items()
    }
    times = gm.best_times(sides, setup.device, repeats)
    seconds = {mode: statistics.median(ts) for mode, ts in times.items()}
    return {
        "repetitions": repeats,
        "seconds": seconds,
        "speedup": seconds["off"] / seconds["auto"] if seconds["auto"] > 0 else None,
    }


def _row_failures(key: str, row: dict[str, Any], sets: Sequence[gs.GroupSet]) -> list[str]:
    """What in ``row`` breaks the step: sharing off, errors, disagreement, wrong token counts."""
    if row["status"] not in ("ok", "running"):
        return []
    if not row.get("sharing_enabled"):
        return [f"{key}: the load check turned sharing off ({row['prefix_sharing']['auto']})"]
    out = []
    limit, mean_limit = gs.TREE_TOLERANCE[row["dtype"]]
    for gset in sets:
        entry = row["sets"].get(gset.name)
        if entry is None:
            continue
        name = f"{key} {gset.name}"
        if entry["errors"]:
            out.append(f"{name}: scoring errors {entry['errors'][:1]}")
            continue
        diff, mean = entry["max_abs_logp_diff"], entry["mean_abs_logp_diff"]
        if not (diff <= limit and mean <= mean_limit):
            out.append(
                f"{name}: tree vs per-sequence max |Δlogp| {diff:.3g} (tolerance {limit}), "
                f"largest mean {mean:.3g} (tolerance {mean_limit})"
            )
        want = {"off": gset.tokens, "auto": gset.unique_tokens}
        if entry["forward_tokens"] != want:
            out.append(f"{name}: backbone tokens {entry['forward_tokens']}, expected {want}")
    return out


def _row_notes(key: str, row: dict[str, Any], sets: Sequence[gs.GroupSet]) -> list[str]:
    """Findings that do not fail the step: a slower tree, a model blind to its prompt."""
    notes = []
    effect = row.get("context_effect")
    limit = gs.TREE_TOLERANCE["float32"][0]
    if effect is not None and effect < 10 * limit:
        notes.append(
            f"{key}: a new prompt moves log-probs by {effect:.3g} only, under 10x the float32 "
            f"tolerance ({limit}): the comparison could miss a wrong prefix on this model"
        )
    for gset in sets:
        speedup = (row.get("sets") or {}).get(gset.name, {}).get("speedup")
        if gset.shared and isinstance(speedup, float) and speedup < 1.0:
            notes.append(f"{key} {gset.name}: tree rows slower than per-sequence ({speedup:.2f}x)")
    return notes
