"""Benchmark: the naive in-trainer log-prob computation vs the executor, side by side.

``python -m worker.bench [--quick] [--json PATH]`` prints a table and writes a JSON dict of rows
(``{"rows": {name: {...}}, "meta": {...}}``) so other components can add rows (e.g. end to end).

Scenarios:

* ``dense``: a Llama-shaped model (vocab 128,256, hidden 256, 2 layers), 4 x 1,024 tokens, the last
  half of each sequence scored. Naive = pad the batch, ``model(...).logits.float()``,
  ``log_softmax``, ``gather``, mask (what TRL/verl-style trainer code does). Time and peak memory.
* ``ragged``: 64 RL-like sequences (prompt 64-256, completion 16-1,024 tokens, fixed seed) on the
  same shape with a 32,000 vocab; the naive loop pads fixed batches of 4 in arrival order.
  Real (unpadded) tokens per second.

Peak memory on CPU: every measured side runs in a fresh subprocess (so one side's freed heap
cannot hide the other's peak). After the model is built and warmed up, the process resets its RSS
high-water mark (``/proc/self/clear_refs`` = 5) and records its RSS; the figure is
``VmHWM - RSS before`` for the measured call: the extra resident memory that call needed.
On CUDA it is ``torch.cuda.max_memory_allocated`` over the call.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor, peak_rss_bytes

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
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


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


def _measure(fn: Callable[[], Any], repeats: int) -> tuple[dict[str, Any], Any]:
    """Best wall time over ``repeats``, the extra peak RSS of the first call, the last output."""
    gc.collect()
    before = _rss_now()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        exact = True
    except OSError:
        exact = False
    times = []
    peak = 0
    out = None
    for i in range(repeats):
        out = None
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        if i == 0:
            peak = max(0, peak_rss_bytes() - before)
    return {"seconds": min(times), "peak_extra_bytes": peak, "peak_exact": exact}, out


def run_phase(phase: str, quick: bool) -> dict[str, Any]:
    """One side of one scenario, in this process (called in a fresh subprocess)."""
    torch.manual_seed(SEED)
    scenario, side = phase.split(":")
    vocab = DENSE["vocab"] if scenario == "dense" else RAGGED["vocab"]
    seqs = dense_inputs(quick) if scenario == "dense" else ragged_inputs(quick)
    model = build_model(vocab)
    repeats = 1 if quick else 2
    with torch.inference_mode():
        if side == "naive":

            def fn() -> Any:
                return [
                    logps
                    for i in range(0, len(seqs), NAIVE_BATCH)
                    for logps in naive_logps(model, seqs[i : i + NAIVE_BATCH])
                ]

            naive_logps(model, seqs[:1] if scenario == "dense" else seqs[:2])  # warm-up
        else:
            ex = StatelessExecutor(
                ExecutorConfig(logprob_chunk_tokens=CHUNK_TOKENS, max_batch_tokens=16384), model
            )
            ex.score(seqs[:2])  # warm-up

            def fn() -> Any:
                return [s.logps for s in ex.score(seqs).scores]

        result, outputs = _measure(fn, repeats)
    real = sum(len(s.tokens) for s in seqs)
    result.update(
        real_tokens=real,
        scored_tokens=sum(len(s.tokens) - (s.prompt_len or 0) for s in seqs),
        tokens_per_s=real / result["seconds"],
        checksum=float(sum(float(np.sum(o)) for o in outputs)),
    )
    return result


def _subprocess_phase(phase: str, quick: bool) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "worker.bench", "--phase", phase] + (["--quick"] if quick else [])
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench phase {phase} failed:\n{done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def run_all(quick: bool) -> dict[str, Any]:
    """Every scenario, each side in its own subprocess; returns the JSON document."""
    rows: dict[str, Any] = {}
    for scenario in ("dense", "ragged"):
        naive = _subprocess_phase(f"{scenario}:naive", quick)
        execu = _subprocess_phase(f"{scenario}:executor", quick)
        agree = abs(naive["checksum"] - execu["checksum"]) <= 1e-4 * max(
            1.0, abs(naive["checksum"])
        )
        rows[f"{scenario}_naive"] = {"scenario": scenario, "side": "naive", **naive}
        rows[f"{scenario}_executor"] = {"scenario": scenario, "side": "executor", **execu}
        ratio: dict[str, Any] = {
            "scenario": scenario,
            "side": "ratio",
            "time_ratio": execu["seconds"] / naive["seconds"],
            "tokens_per_s_ratio": execu["tokens_per_s"] / naive["tokens_per_s"],
            "peak_memory_ratio": execu["peak_extra_bytes"] / max(1, naive["peak_extra_bytes"]),
            "logps_agree": agree,
        }
        if scenario == "dense":
            ratio["targets"] = {"peak_memory_ratio": "<= 0.2", "time_ratio": "<= 0.35"}
            ratio["met"] = ratio["peak_memory_ratio"] <= 0.2 and ratio["time_ratio"] <= 0.35
        else:
            ratio["targets"] = {"tokens_per_s_ratio": ">= 1.8"}
            ratio["met"] = ratio["tokens_per_s_ratio"] >= 1.8
        rows[f"{scenario}_ratio"] = ratio
    meta = {
        "quick": quick,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "load_average": os.getloadavg(),
        "dense": DENSE,
        "ragged": {**RAGGED, "sequences": 16 if quick else RAGGED["sequences"]},
        "naive_batch": NAIVE_BATCH,
        "executor_chunk_tokens": CHUNK_TOKENS,
        "memory_method": (
            "each side in a fresh subprocess; after model build + warm-up the RSS high-water "
            "mark is reset (/proc/self/clear_refs=5); peak_extra = VmHWM - RSS before the call"
        ),
    }
    return {"rows": rows, "meta": meta}


def format_table(doc: dict[str, Any]) -> str:
    """Human-readable table of the rows."""
    lines = [
        f"{'row':<18} {'seconds':>9} {'tokens/s':>10} {'peak MB':>9}  notes",
        "-" * 72,
    ]
    for name, row in doc["rows"].items():
        if row.get("side") == "ratio":
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
    """Entry point of ``python -m worker.bench`` / ``scoring-worker bench``."""
    parser = argparse.ArgumentParser(prog="worker.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sequences, one repetition")
    parser.add_argument("--json", default="bench-results.json", help="where to write the rows")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:
        print(json.dumps(run_phase(args.phase, args.quick)))
        return 0
    doc = run_all(args.quick)
    print(format_table(doc))
    with open(args.json, "w") as fh:
        json.dump(doc, fh, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
