"""Benchmark scenario ``teacher``: distillation outputs at V = 128,256, side by side.

Three sides on the ``dense`` shape of ``worker.devtools.bench.executor`` (the same Llama-shaped
model, 4 x 1,024 tokens with the last 512 scored; 2 sequences with ``--quick``), one process:

* ``logps``: the executor, log-probs alone (today's job);
* ``teacher``: the executor asked for ``logps`` + ``entropy`` + top-64 (ids, log-probs, tail);
* ``naive``: the in-trainer way, full float32 logits ``[B, T, V]``, ``log_softmax``, gather and
  ``topk(64)`` (entropy not even included, which would cost the naive side one more ``[B, T, V]``).

Targets (issue "Teacher outputs"): teacher vs logps time <= 1.3x and peak memory <= 1.1x;
teacher vs naive peak memory <= 0.2x. Peak memory is measured as in ``bench`` (RSS high-water
mark above the RSS before the call); time is the median of 5 interleaved rounds, the order of the
sides rotated each round.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.request import ScoreOptions
from worker.scorer.teacher import TokenOutputs

TOPK = 64


def naive_teacher(model: torch.nn.Module, seqs: list[SequenceInput]) -> list[np.ndarray]:
    """Full float32 logits, log_softmax, gather and top-k, read at the scored positions."""
    ids = torch.stack([torch.as_tensor(s.tokens) for s in seqs])  # [B, T] (equal lengths)
    logits = model(input_ids=ids, use_cache=False).logits.float()  # [B, T, V]
    logps = torch.log_softmax(logits[:, :-1], dim=-1)  # [B, T-1, V]
    picked = logps.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    top = logps.topk(TOPK, dim=-1).values  # [B, T-1, k]
    out = []
    for i, s in enumerate(seqs):
        p = int(s.prompt_len or 1)
        out += [picked[i, p - 1 :].numpy(), top[i, p - 1 :].numpy()]
    return out


def run_teacher(
    model: torch.nn.Module,
    seqs: list[SequenceInput],
    peak_extra: Callable[[Callable[[], Any]], tuple[int, float, Any]],
    quick: bool,
) -> dict[str, Any]:
    """The three sides on ``model`` (V = 128,256) and ``seqs`` (equal lengths), memory first
    (``peak_extra``: bench's RSS high-water measure; executor sides before the naive one), then
    interleaved timing; returns one table row with the ratios and the targets."""
    ex = StatelessExecutor(ExecutorConfig(max_batch_tokens=16384), model)
    options = ScoreOptions(outputs=TokenOutputs(frozenset({"logps", "entropy", "topk"}), topk=TOPK))

    def logps() -> list[Any]:
        return [s.logps for s in ex.score(seqs).scores]

    def teacher() -> list[Any]:
        scores = ex.score(seqs, options=options).scores
        return [x for s in scores for x in (s.logps, (s.arrays or {}).get("topk_logps"))]

    sides: dict[str, Callable[[], list[Any]]] = {
        "teacher": teacher,
        "logps": logps,
        "naive": lambda: naive_teacher(model, seqs),
    }
    peaks: dict[str, int] = {}
    times: dict[str, list[float]] = {name: [] for name in sides}
    outs: dict[str, list[Any]] = {}
    with torch.inference_mode():
        ex.score(seqs[:1], options=options)  # warm-up
        for name, fn in sides.items():
            peaks[name], seconds, outs[name] = peak_extra(fn)
            times[name].append(seconds)
        names = list(sides)
        for r in range(1 if quick else 5):  # medians of 5: single rounds move by +-15% here
            # rotated each round: a side timed right after the naive one (which just freed GBs)
            # was measured up to ~15% slower, so no side always follows it
            for name in names[r % 3 :] + names[: r % 3]:
                t0 = time.perf_counter()
                sides[name]()
                times[name].append(time.perf_counter() - t0)
    vocab = ex.vocab_size
    ex.close()
    agree = all(
        np.allclose(a, b, atol=1e-4) for a, b in zip(outs["teacher"], outs["naive"], strict=True)
    ) and all(
        np.array_equal(a, b) for a, b in zip(outs["teacher"][::2], outs["logps"], strict=True)
    )
    sec = {name: statistics.median(t) for name, t in times.items()}
    row: dict[str, Any] = {
        "scenario": "teacher",
        "side": "teacher",
        "vocab": vocab,
        "topk": TOPK,
        "scored_tokens": sum(len(s.tokens) - int(s.prompt_len or 0) for s in seqs),
        "seconds": sec,
        "peak_extra_bytes": peaks,
        "time_vs_logps": sec["teacher"] / sec["logps"],
        "mem_vs_logps": peaks["teacher"] / max(1, peaks["logps"]),
        "time_vs_naive": sec["teacher"] / sec["naive"],
        "mem_vs_naive": peaks["teacher"] / max(1, peaks["naive"]),
        "agree": bool(agree),
        "targets": {"time_vs_logps": "<= 1.3", "mem_vs_logps": "<= 1.1", "mem_vs_naive": "<= 0.2"},
    }
    row["met"] = (
        row["time_vs_logps"] <= 1.3 and row["mem_vs_logps"] <= 1.1 and row["mem_vs_naive"] <= 0.2
    )
    return row


def format_row(name: str, row: dict[str, Any]) -> str:
    """The scenario's line of the bench table."""
    mb = {k: v / 2**20 for k, v in row["peak_extra_bytes"].items()}
    return (
        f"{name:<18} {row['seconds']['teacher']:>9.3f} {'':>10} {mb['teacher']:>9.1f}  "
        f"logps+entropy+top{row['topk']} vs logps: time x{row['time_vs_logps']:.2f} "
        f"mem x{row['mem_vs_logps']:.2f}; vs naive: time x{row['time_vs_naive']:.2f} "
        f"mem x{row['mem_vs_naive']:.3f} (logps {mb['logps']:.0f} MB, naive {mb['naive']:.0f} MB)"
        f"  agree={row['agree']} target met={row['met']}"
    )
