"""Per-rank memory of a tensor-parallel group on the CPU: ``scoring-worker bench --suite
tensor-parallel`` (``python -m worker.devtools.bench.tensor_parallel [--quick] [--sizes 1,2]``).

A random Llama checkpoint is saved once (``SHAPES``), in bfloat16 and loaded as float32, so
every rank copies what it holds and its RSS counts exactly its own weights (a float32 checkpoint
is memory-mapped: its pages would count in whichever rank touched them). For each size N, N
ranks join a gloo group (``worker.processes.tp_local``: the group's own rendezvous and
collectives), load it
sharded with ``ParallelExecutor.load`` and score one batch through the leader's
``GroupScorer``. Each rank reports the parameter bytes it holds, its RSS when it started
(torch and transformers imported, the group joined, nothing loaded), after loading, and its
peak RSS during the batch (the executor's per-call memory accounting: ``VmHWM`` after
``clear_refs``). N = 1 is the plain one-process ``StatelessExecutor`` on the same checkpoint.
The table shows, per rank, the weights it holds (about 1/N), what loading added to its RSS and
what the batch added on top (activations and the LM head's blocks: ``[c, V / N]``, never
``[rows, V]``, whose size the table prints beside it).

``serve_calls`` (the group answering a list of calls) is also what the tests' two-rank scenarios
(``tests/support/tp_ranks.py``) and the GPU check's ``tp`` step use.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from worker.processes.tp_local import join, launch

SHAPES: dict[str, dict[str, int]] = {
    # 160M parameters, 640 MB in float32: the weights dominate a rank's RSS
    "full": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
             "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000,
             "seqs": 8, "length": 512, "prompt": 64},
    "quick": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000,
              "seqs": 4, "length": 256, "prompt": 32},
}  # fmt: skip
MIB = 1 << 20


def rss_bytes() -> int:
    """This process's resident set size now (``VmRSS``)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def serve_calls(executor: Any, comm: Any, calls: list[Any]) -> list[Any]:
    """Run ``calls`` (``ScoreRequest`` s) on the group: rank 0 broadcasts them (``GroupScorer``)
    and returns the outputs (a call that failed with a ``ScoringError``: ``(name, code,
    message)`` in its place); the others follow until the leader stops and return theirs."""
    from worker.errors import ScoringError
    from worker.executor.parallel.group import GroupScorer, StepClock, follow

    outputs: list[Any] = []
    if comm.rank == 0:
        scorer = GroupScorer(executor, comm, StepClock())
        for call in calls:
            kwargs = {"mode": call.mode, "temperature": call.temperature, "options": call.options}
            try:
                outputs.append(scorer.score(call.seqs, **kwargs))
            except ScoringError as exc:
                outputs.append((type(exc).__name__, exc.code, exc.message))
        scorer.close()
        return outputs
    run = executor.run

    def recording(*args: Any, **kwargs: Any) -> Any:
        outputs.append(run(*args, **kwargs))
        return outputs[-1]

    executor.run = recording
    try:
        follow(executor, comm, StepClock())
    finally:
        del executor.run  # the class's method again
    return outputs


def _rank(args: argparse.Namespace) -> None:
    """One rank of a measured group (or the one process, ``--size 1``)."""
    import numpy as np
    import torch
    import transformers
    import transformers.models.llama.modeling_llama as llama

    from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
    from worker.executor.parallel.executor import ParallelExecutor
    from worker.executor.parallel.plan import tensor_parallel_plan
    from worker.request import ScoreRequest
    from worker.scorer import DEFAULT_OPTIONS

    del llama  # imported before "start", with the rest of the code a rank runs

    shape = SHAPES[args.shape]
    comm = join(args.rank, args.size, args.port) if args.size > 1 else None
    start = rss_bytes()  # torch, transformers and the group are there; no weights yet
    rng = np.random.default_rng(0)
    seqs = [
        SequenceInput(rng.integers(1, shape["vocab_size"], shape["length"]), shape["prompt"])
        for _ in range(shape["seqs"])
    ]
    config = ExecutorConfig(
        mode="reference",
        device="cpu",
        dtype="float32",
        max_batch_tokens=1 << 20,
        bucket_pad_fraction=1.0,
    )
    t0 = time.perf_counter()
    if args.size == 1:
        ex: Any = StatelessExecutor.from_pretrained(config, reference_model=args.model)
        loaded = rss_bytes()
        out = ex.score(seqs)
    else:
        assert comm is not None
        plan = tensor_parallel_plan(transformers.AutoConfig.from_pretrained(args.model), args.size)
        ex = ParallelExecutor.load(config, comm, [plan], reference_model=args.model)
        loaded = rss_bytes()
        (out,) = serve_calls(ex, comm, [ScoreRequest(seqs, None, None, DEFAULT_OPTIONS)])
        comm.close()
    model = ex.reference_model
    held = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
        for p in model.parameters()
    )
    doc = {"rank": args.rank, "size": args.size, "start": start, "loaded": loaded,
           "peak": out.metrics.peak_allocated_bytes, "weights": held,
           "rows": out.metrics.scored_tokens, "seconds": round(time.perf_counter() - t0, 1),
           "logps_sum": float(sum(float(s.logps.astype(np.float64).sum()) for s in out.scores)),
           "threads": torch.get_num_threads()}  # fmt: skip
    Path(args.out).write_text(json.dumps(doc))


def _save_model(shape: dict[str, int], where: Path) -> None:
    import torch
    from transformers import LlamaConfig

    from worker.demo.tiny import random_model

    keep: dict[str, Any] = {k: v for k, v in shape.items() if k not in ("seqs", "length", "prompt")}
    cfg = LlamaConfig(**keep, max_position_embeddings=2048, tie_word_embeddings=False)
    model: Any = random_model("LlamaForCausalLM", cfg, 0)
    model.to(torch.bfloat16).save_pretrained(where)


def main(argv: Sequence[str] | None = None) -> int:
    """The table (module docstring); ``--rank`` runs one rank (what ``launch`` starts)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and batch")
    parser.add_argument("--sizes", default="1,2", help="group sizes to measure (default 1,2)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--shape", default="full", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        _rank(args)
        return 0
    name = "quick" if args.quick else "full"
    shape = SHAPES[name]
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as tmp:
        root = Path(tmp)
        _save_model(shape, root / "model")
        rows_v = shape["seqs"] * (shape["length"] - shape["prompt"]) * shape["vocab_size"] * 4
        print(
            f"tensor parallel, CPU over gloo: random Llama {name} ({shape}), float32; one "
            f"batch; a [rows, V] float32 block would be {rows_v / MIB:,.0f} MiB"
        )
        print("| ranks | rank | weights held | RSS start | + load | + batch (peak) | logps sum |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for size in (int(s) for s in args.sizes.split(",")):
            extra = ["--model", str(root / "model"), "--shape", name]
            out = root / f"n{size}"
            out.mkdir()
            for path in launch(size, "worker.devtools.bench.tensor_parallel", extra, out=out):
                r = json.loads(path.read_text())
                cells = [
                    r["weights"],
                    r["start"],
                    r["loaded"] - r["start"],
                    r["peak"] - r["loaded"],
                ]
                mib = " | ".join(f"{c / MIB:,.0f} MiB" for c in cells)
                print(f"| {size} | {r['rank']} | {mib} | {r['logps_sum']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
