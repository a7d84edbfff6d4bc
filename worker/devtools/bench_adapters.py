"""Per-job weights benchmark: jobs spread over 3 resident LoRA adapters vs the same jobs on the base
model, the cost of a cold adapter load, and a full-model switch per job (why a queue per
distinct full model beats per-job versions that change every job).

Everything runs in one process on one executor, the variants interleaved round by round; the
figures are medians over rounds. A random llama-shaped model (``--hidden``, ``--layers``) is saved
to a temporary directory with three rank-``--rank`` adapters (q/k/v/o and MLP projections) and
two full checkpoints. ``scoring-worker bench --suite adapters [-- --quick]``. Needs ``peft``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(hidden: int, layers: int, seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 3,
        num_hidden_layers=layers, num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 128, 1), max_position_embeddings=4096,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def _save_adapter(base: Any, path: Path, seed: int, rank: int) -> None:
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, target_modules=TARGETS))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.01)
    peft_model.save_pretrained(str(path))


def _layout(root: Path, hidden: int, layers: int, rank: int) -> None:
    base = _model(hidden, layers, 0)
    base.save_pretrained(str(root / "base"))
    for i in range(4):
        _save_adapter(base, root / "adapters" / f"a{i}", i + 1, rank)
    for i in range(2):
        _model(hidden, layers, 10 + i).save_pretrained(str(root / "models" / f"step-{i}"))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table (and ``--json``)."""
    p = argparse.ArgumentParser(prog="bench adapters", description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--jobs", type=int, default=24)
    p.add_argument("--seqs", type=int, default=4, help="sequences per job")
    p.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.jobs, args.rounds, args.tokens = 128, 2, 9, 3, 64
    from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
    from worker.executor.residency import WeightsConfig
    from worker.scorer.options import ScoreOptions

    rng = np.random.default_rng(0)
    jobs = [
        [
            SequenceInput(rng.integers(0, 4096, args.tokens, dtype=np.int32), prompt_len=16)
            for _ in range(args.seqs)
        ]
        for _ in range(args.jobs)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _layout(root, args.hidden, args.layers, args.rank)

        def executor(**weights: Any) -> Any:
            cfg = WeightsConfig(
                adapter_root=str(root / "adapters"), model_root=str(root / "models"), **weights
            )
            return StatelessExecutor.from_pretrained(
                ExecutorConfig(device=args.device), str(root / "base"), weights=cfg
            )

        warm = executor(preload=("a0", "a1", "a2"))
        cold = executor(max_resident_adapters=1)
        thrash = executor(max_resident_versions=1)
        variants = {
            "base (one model)": (warm, lambda i: ScoreOptions()),
            "3 resident adapters": (warm, lambda i: ScoreOptions(adapter=f"a{i % 3}")),
            "adapter load per job": (cold, lambda i: ScoreOptions(adapter=f"a{i % 2 + 2}")),
            "full-model switch per job": (thrash, lambda i: ScoreOptions(version=f"step-{i % 2}")),
        }
        rates: dict[str, list[float]] = {name: [] for name in variants}
        loads: dict[str, list[float]] = {"adapter": [], "version": []}
        for _ in range(args.rounds):
            for name, (ex, options) in variants.items():
                started = time.perf_counter()
                for i, job in enumerate(jobs):
                    report = ex.score(job, options=options(i)).metrics.weights
                    for event in report.loads if report is not None else ():
                        loads[event.kind].append(event.seconds)
                rates[name].append(len(jobs) / (time.perf_counter() - started))
    med = {name: statistics.median(r) for name, r in rates.items()}
    base = med["base (one model)"]
    out = {
        "jobs_per_s": med,
        "ratio_vs_base": {name: rate / base for name, rate in med.items()},
        "cold_adapter_load_ms": 1000 * statistics.median(loads["adapter"]),
        "full_model_load_ms": 1000 * statistics.median(loads["version"]),
        "shape": {k: getattr(args, k) for k in ("hidden", "layers", "rank", "jobs", "seqs",
                                               "tokens", "rounds", "device")},
    }  # fmt: skip
    print(f"per-job weights, {args.jobs} jobs x {args.seqs} seqs x {args.tokens} tokens, "
          f"hidden {args.hidden}, {args.layers} layers, LoRA rank {args.rank}, {args.device}, "
          f"median of {args.rounds} interleaved rounds")  # fmt: skip
    print(f"{'variant':28} {'jobs/s':>9} {'vs base':>8}")
    for name, rate in med.items():
        print(f"{name:28} {rate:9.2f} {rate / base:7.2f}x")
    print(f"cold adapter load: {out['cold_adapter_load_ms']:.1f} ms (median); "
          f"full checkpoint load: {out['full_model_load_ms']:.1f} ms")  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
