"""Benchmark: the naive in-trainer log-prob computation vs the executor, side by side.

``python -m worker.devtools.bench.executor [--quick] [--json PATH]``
(= ``scoring-worker bench --suite executor``)
prints a table and writes a JSON dict of rows
(``{"rows": {name: {...}}, "meta": {...}}``) so other components can add rows (e.g. end to end).

Scenarios:

* ``dense``: a Llama-shaped model (vocab 128,256, hidden 256, 2 layers), 4 x 1,024 tokens, the last
  half of each sequence scored. Naive = pad the batch, ``model(...).logits.float()``,
  ``log_softmax``, ``gather``, mask (what TRL/verl-style trainer code does). Time and peak memory.
* ``ragged``: 64 RL-like sequences (prompt 64-256, completion 16-1,024 tokens, fixed seed) on the
  same shape with a 32,000 vocab; the naive loop pads fixed batches of 4 in arrival order.
  Real (unpadded) tokens per second. The smaller vocab keeps the row about packing and padding:
  at 128,256 the LM head is ~90% of both sides' work on this CPU and runs on the ~3/4 of tokens
  that are scored either way (one such run: 1.34x tokens/s, 12 minutes instead of 2).
* ``teacher``: logps + entropy + top-64 at V = 128,256 vs logps alone and vs the naive
  in-trainer way (``worker.devtools.bench.teacher``).

Both sides run in one process on the same model. Peak memory (CPU): tracemalloc cannot see
torch's allocator, so before each side's measured call the process records its RSS and resets its
RSS high-water mark (``/proc/self/clear_refs`` = 5); the figure is ``VmHWM - RSS before``, the
extra resident memory that call needed. The executor is measured first, on a heap the naive side
has not grown (glibc returns the naive side's multi-GB buffers to the OS, as they are mmaps).
Time: best wall time of interleaved naive / executor runs after a warm-up, so both sides see the
same machine load.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from worker.demo.tiny import llama_config, random_model
from worker.devtools.bench.teacher import format_row as format_teacher_row
from worker.devtools.bench.teacher import run_teacher
from worker.devtools.machine import this_machine
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.executor.memory import peak_rss_bytes

SEED = 1234
DENSE: dict[str, Any] = {"vocab": 128_256, "batch": 4, "length": 1024, "scored": 512}
RAGGED: dict[str, Any] = {
    "vocab": 32_000,
    "sequences": 64,
    "prompt": (64, 256),
    "completion": (16, 1024),
}
NAIVE_BATCH = 4
CHUNK_TOKENS = 256  # executor LM-head chunk: 256 x 128,256 x 4 B = 131 MB extra at most


def build_model(vocab: int) -> torch.nn.Module:
    """Llama-shaped model: hidden 256, 2 layers, 4 heads (2 KV), fixed seed, float32, eval."""
    config = llama_config(vocab, 256, 1024, 2048, tie_word_embeddings=False)
    return random_model("LlamaForCausalLM", config, SEED)


def naive_logps(
    model: torch.nn.Module, seqs: list[SequenceInput], temperature: float = 1.0
) -> list[np.ndarray]:
    """The in-trainer baseline: right-pad, full logits in float32, log_softmax, gather, mask."""
    width = max(len(s.tokens) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)  # [B, T]
    attn = torch.zeros_like(ids)  # [B, T]
    loss_mask = torch.zeros_like(ids)  # [B, T]
    for i, s in enumerate(seqs):
        n = len(s.tokens)
        ids[i, :n] = torch.as_tensor(s.tokens)
        attn[i, :n] = 1
        loss_mask[i, int(s.prompt_len or 1) : n] = 1
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits.float()  # [B,T,V]
    if temperature != 1.0:
        logits = logits / temperature  # [B, T, V]
    logps = torch.log_softmax(logits[:, :-1], dim=-1)  # [B, T-1, V]
    picked = logps.gather(-1, ids[:, 1:, None]).squeeze(-1) * loss_mask[:, 1:]  # [B, T-1]
    return [
        picked[i, int(s.prompt_len or 1) - 1 : len(s.tokens) - 1].numpy()
        for i, s in enumerate(seqs)
    ]


def dense_inputs(quick: bool) -> list[SequenceInput]:
    rng = np.random.default_rng(SEED)
    batch, length, scored = DENSE["batch"], DENSE["length"], DENSE["scored"]
    return [
        SequenceInput(rng.integers(0, DENSE["vocab"], length), prompt_len=length - scored)
        for _ in range(batch)
    ]


def ragged_inputs(quick: bool) -> list[SequenceInput]:
    rng = np.random.default_rng(SEED)
    n = 16 if quick else RAGGED["sequences"]
    out = []
    for _ in range(n):
        prompt = int(rng.integers(RAGGED["prompt"][0], RAGGED["prompt"][1] + 1))
        completion = int(rng.integers(RAGGED["completion"][0], RAGGED["completion"][1] + 1))
        tokens = rng.integers(0, RAGGED["vocab"], prompt + completion)
        out.append(SequenceInput(tokens, prompt_len=prompt))
    return out


def _rss_now() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _clear_peak() -> bool:
    """Reset this process's RSS high-water mark (Linux); False when not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere), so a
    call's allocations show in RSS instead of reusing pages an earlier side left resident."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _peak_extra(fn: Callable[[], Any]) -> tuple[int, float, Any]:
    """(extra peak RSS bytes, seconds, output) of one call of ``fn``."""
    gc.collect()
    _trim_heap()
    before = _rss_now()
    _clear_peak()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    return max(0, peak_rss_bytes() - before), seconds, out


def _checksum(outputs: list[np.ndarray]) -> float:
    return float(sum(float(np.sum(o, dtype=np.float64)) for o in outputs))


def run_scenario(scenario: str, quick: bool) -> dict[str, dict[str, Any]]:
    """Both sides of one scenario in this process: memory first, then interleaved timing."""
    vocab = DENSE["vocab"] if scenario == "dense" else RAGGED["vocab"]
    seqs = dense_inputs(quick) if scenario == "dense" else ragged_inputs(quick)
    model = build_model(vocab)
    ex = StatelessExecutor(
        ExecutorConfig(logprob_chunk_tokens=CHUNK_TOKENS, max_batch_tokens=16384), model
    )

    def naive() -> list[np.ndarray]:
        return [
            logps
            for i in range(0, len(seqs), NAIVE_BATCH)
            for logps in naive_logps(model, seqs[i : i + NAIVE_BATCH])
        ]

    def executor() -> list[np.ndarray]:
        return [s.logps for s in ex.score(seqs).scores if s.logps is not None]

    sides: dict[str, Callable[[], list[np.ndarray]]] = {"executor": executor, "naive": naive}
    rounds = 1 if quick or scenario == "ragged" else 2
    rows: dict[str, dict[str, Any]] = {}
    with torch.inference_mode():
        naive_logps(model, seqs[:1])  # warm-up: kernels, allocator, first-touch of weights
        ex.score(seqs[:1])
        # Memory: the executor first, on a heap the naive side has not grown; the naive side's
        # multi-GB buffers are fresh mmaps either way.
        for side, fn in sides.items():
            peak, seconds, out = _peak_extra(fn)
            rows[side] = {"peak_extra_bytes": peak, "times": [seconds], "checksum": _checksum(out)}
        for _ in range(rounds):  # interleaved so both sides see the same machine load
            for side, fn in sides.items():
                t0 = time.perf_counter()
                fn()
                rows[side]["times"].append(time.perf_counter() - t0)
    real = sum(len(s.tokens) for s in seqs)
    scored = sum(len(s.tokens) - int(s.prompt_len or 0) for s in seqs)
    for row in rows.values():
        row.update(
            seconds=min(row["times"]),
            real_tokens=real,
            scored_tokens=scored,
            tokens_per_s=real / min(row["times"]),
        )
    ex.close()
    return rows


def run_all(quick: bool) -> dict[str, Any]:
    """Every scenario; returns the JSON document (a dict of rows plus metadata)."""
    exact = _clear_peak()
    rows: dict[str, Any] = {}
    for scenario in ("dense", "ragged"):
        sides = run_scenario(scenario, quick)
        naive, execu = sides["naive"], sides["executor"]
        tol = 1e-5 * max(1.0, abs(naive["checksum"]))
        rows[f"{scenario}_naive"] = {"scenario": scenario, "side": "naive", **naive}
        rows[f"{scenario}_executor"] = {"scenario": scenario, "side": "executor", **execu}
        ratio: dict[str, Any] = {
            "scenario": scenario,
            "side": "ratio",
            "time_ratio": execu["seconds"] / naive["seconds"],
            "tokens_per_s_ratio": execu["tokens_per_s"] / naive["tokens_per_s"],
            "peak_memory_ratio": execu["peak_extra_bytes"] / max(1, naive["peak_extra_bytes"]),
            "logps_agree": abs(naive["checksum"] - execu["checksum"]) <= tol,
        }
        if scenario == "dense":
            ratio["targets"] = {"peak_memory_ratio": "<= 0.2", "time_ratio": "<= 0.35"}
            ratio["met"] = ratio["peak_memory_ratio"] <= 0.2 and ratio["time_ratio"] <= 0.35
        else:
            ratio["targets"] = {"tokens_per_s_ratio": ">= 1.8"}
            ratio["met"] = ratio["tokens_per_s_ratio"] >= 1.8
        rows[f"{scenario}_ratio"] = ratio
    teacher_seqs = dense_inputs(quick)[: 2 if quick else DENSE["batch"]]  # bench_teacher
    rows["teacher_v128k"] = run_teacher(
        build_model(DENSE["vocab"]), teacher_seqs, _peak_extra, quick
    )
    meta = {
        "quick": quick,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "load_average": os.getloadavg(),
        "cpu": this_machine().describe(),
        "dense": DENSE,
        "ragged": {**RAGGED, "sequences": 16 if quick else RAGGED["sequences"]},
        "naive_batch": NAIVE_BATCH,
        "executor_chunk_tokens": CHUNK_TOKENS,
        "peak_exact": exact,
        "memory_method": (
            "one process; per side: freed heap handed back (malloc_trim), RSS before the "
            "call, RSS high-water mark reset "
            "(/proc/self/clear_refs=5), peak_extra = VmHWM - RSS before; executor measured first"
        ),
        "time_method": "best wall time of interleaved naive/executor runs after a warm-up",
    }
    return {"rows": rows, "meta": meta}


def format_table(doc: dict[str, Any]) -> str:
    """Human-readable table of the rows."""
    lines = [
        f"{'row':<18} {'seconds':>9} {'tokens/s':>10} {'peak MB':>9}  notes",
        "-" * 72,
    ]
    for name, row in doc["rows"].items():
        if row.get("side") == "teacher":
            lines.append(format_teacher_row(name, row))
        elif row.get("side") == "ratio":
            note = (
                f"time x{row['time_ratio']:.3f}  mem x{row['peak_memory_ratio']:.3f}  "
                f"tok/s x{row['tokens_per_s_ratio']:.2f}  agree={row['logps_agree']}  "
                f"target met={row['met']}"
            )
            lines.append(f"{name:<18} {'':>9} {'':>10} {'':>9}  {note}")
        elif "seconds" in row:
            lines.append(
                f"{name:<18} {row['seconds']:>9.3f} {row['tokens_per_s']:>10.0f} "
                f"{row['peak_extra_bytes'] / 2**20:>9.1f}  real={row['real_tokens']} "
                f"scored={row['scored_tokens']}"
            )
    lines.append("")
    lines.append("peak MB: " + doc["meta"]["memory_method"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m worker.devtools.bench.executor`` / ``scoring-worker bench``."""
    parser = argparse.ArgumentParser(
        prog="worker.devtools.bench.executor", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer sequences, one repetition")
    parser.add_argument("--json", default="bench-results.json", help="where to write the rows")
    args = parser.parse_args(argv)
    doc = run_all(args.quick)
    print(format_table(doc))
    with open(args.json, "w") as fh:
        json.dump(doc, fh, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
