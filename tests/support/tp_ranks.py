"""One rank of the two-rank group scenarios of ``tests/executor/test_tensor_parallel_group.py``.

``python -m tests.support.tp_ranks --rank R --size 2 --port P --out FILE --models DIR`` (started
by ``worker.processes.tp_local.launch``). Both ranks run the same phases in the same
order; each phase builds its executor on the group and serves a few calls (rank 0 broadcasts,
rank 1 follows until rank 0 stops it), with faults injected on some ranks only:

* ``outputs``: teacher outputs, rewards and plain log-probs (mode ``both``, ``reward``), and
  ``hidden`` rows alone;
* ``oom_head``: rank 1 alone runs out of memory in its LM-head fold above 12 rows: both halve;
* ``oom_backbone``: both ranks run out of memory in the last MLP above 40 tokens: both halve;
* ``kernel``: sdpa fails on both ranks: both retry on eager;
* ``kv``: the backbone returns a KV cache on both ranks: the batch is rejected on both (the
  group serves on: the next phase runs);
* ``memory`` (``DIR/wide``, vocabulary 32,768): each rank's RSS before the call and its peak;
* ``tree``: a group sharing a 40-id prompt and, for four of them, a 36-id turn after it: tree
  rows on both ranks (teacher outputs and rewards in ``both``, plain log-probs).

Each rank pickles what it saw (rank 0: the outputs) to ``FILE``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

EQUAL = [[7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53][: 13 - i] + [5] * i for i in range(4)]
"""Four sequences of one length (13), so they share a bucket on the CPU."""


def _tree_ids() -> list[list[int]]:
    """Six sequences sharing a 40-id prompt, four of them a 36-id turn after it (two levels)."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(1, 96, 40).tolist()
    turns = [rng.integers(1, 96, 36).tolist() for _ in range(2)]
    out = [prompt + turns[i // 2] + rng.integers(1, 96, 3 + i).tolist() for i in range(4)]
    return out + [prompt + rng.integers(1, 96, 5 + i).tolist() for i in range(2)]


def _calls() -> dict[str, list[Any]]:
    from worker.executor import SequenceInput
    from worker.request import ScoreRequest
    from worker.scorer import DEFAULT_OPTIONS, ScoreOptions
    from worker.scorer.teacher import TokenOutputs

    spec = TokenOutputs(
        frozenset({"logps", "entropy", "topk", "gather", "hidden"}), topk=6,
        gather_ids=(2, 47, 95), hidden_dtype="float32",  # hidden: rank 0's replicated rows
    )  # fmt: skip
    rows_only = TokenOutputs(frozenset({"hidden"}), hidden_dtype="float32")  # no LM head
    ragged = [SequenceInput([1, 5, 9, 14, 2, 77, 8], 2), SequenceInput(list(range(3, 30)), 5)]
    equal = [SequenceInput(ids, prompt_len=5) for ids in EQUAL]
    rng = np.random.default_rng(0)
    wide = [SequenceInput(rng.integers(1, 32768, 256), 1) for _ in range(48)]
    tree = [SequenceInput(ids, prompt_len=40) for ids in _tree_ids()]
    return {
        "tree": [
            ScoreRequest(tree, "both", 0.8, ScoreOptions(outputs=spec)),
            ScoreRequest(tree, "reference", None, DEFAULT_OPTIONS),
        ],
        "outputs": [
            ScoreRequest(ragged, "both", 0.7, ScoreOptions(outputs=spec)),
            ScoreRequest(ragged, "reward", None, DEFAULT_OPTIONS),
            ScoreRequest(ragged, "reference", None, DEFAULT_OPTIONS),
            ScoreRequest(ragged, "reference", None, ScoreOptions(outputs=rows_only)),
        ],
        "oom_head": [ScoreRequest(equal, "reference", None, DEFAULT_OPTIONS)],
        "oom_backbone": [ScoreRequest(equal, "reference", None, DEFAULT_OPTIONS)],
        "kernel": [ScoreRequest(equal, "reference", None, DEFAULT_OPTIONS)],
        "kv": [ScoreRequest(equal, "reference", None, DEFAULT_OPTIONS)],
        "memory": [ScoreRequest(wide, "reference", None, DEFAULT_OPTIONS)],
    }


def _inject(phase: str, rank: int, model: Any) -> Any:
    """Patch this rank for ``phase`` (``model``: the reference model served); returns an undo
    function."""
    from transformers.modeling_utils import AttentionInterface
    from transformers.models.llama.modeling_llama import LlamaMLP

    from worker.executor.parallel.head import VocabShard

    if phase == "oom_head" and rank == 1:
        real = VocabShard.logits

        def logits(self: VocabShard, hidden: torch.Tensor, *args: Any) -> torch.Tensor:
            if hidden.shape[0] > 12:
                raise torch.OutOfMemoryError(f"simulated: {hidden.shape[0]} rows on rank 1")
            return real(self, hidden, *args)

        VocabShard.logits = logits  # type: ignore[method-assign]
        return lambda: setattr(VocabShard, "logits", real)
    if phase == "oom_backbone":
        forward = LlamaMLP.forward

        def mlp(self: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] * x.shape[1] > 40:
                raise torch.OutOfMemoryError("simulated: the MLP's activations")
            return forward(self, x)

        LlamaMLP.forward = mlp  # type: ignore[method-assign]
        return lambda: setattr(LlamaMLP, "forward", forward)
    if phase == "kernel":
        mapping = AttentionInterface._global_mapping
        sdpa = mapping["sdpa"]

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("simulated sdpa kernel failure")

        mapping["sdpa"] = broken
        return lambda: mapping.__setitem__("sdpa", sdpa)
    if phase == "kv":  # as tests/executor/test_kv.py leaks one
        from transformers.cache_utils import DynamicCache

        backbone = model.model
        original = backbone.forward

        def leaking(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            cache = DynamicCache(config=model.config)
            kv = out.last_hidden_state.new_zeros(1, 2, 4, 8)
            for layer in range(model.config.num_hidden_layers):
                cache.update(kv.clone(), kv.clone(), layer)
            out["past_key_values"] = cache
            return out

        backbone.forward = leaking
        return lambda: setattr(backbone, "forward", original)
    return lambda: None


def main() -> None:
    import transformers

    from worker.devtools.bench.tensor_parallel import rss_bytes, serve_calls
    from worker.executor import ExecutorConfig
    from worker.executor.parallel.executor import ParallelExecutor
    from worker.executor.parallel.plan import tensor_parallel_plan
    from worker.processes.tp_local import join

    parser = argparse.ArgumentParser()
    for flag in ("--rank", "--size", "--port"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", required=True)
    args = parser.parse_args()
    comm = join(args.rank, args.size, args.port)
    root = Path(args.models)

    def load(name: str, reward: bool) -> ParallelExecutor:
        ref = str(root / name)
        plans = [tensor_parallel_plan(transformers.AutoConfig.from_pretrained(ref), args.size)]
        config = ExecutorConfig(mode="both" if reward else "reference", device="cpu")
        rew = str(root / "rew") if reward else None
        return ParallelExecutor.load(config, comm, plans, reference_model=ref, reward_model=rew)

    seen: dict[str, Any] = {"rank": args.rank}
    main_ex = load("ref", reward=True)
    seen["prefix_sharing"] = main_ex.info["prefix_sharing"]
    for phase, calls in _calls().items():
        ex = load("wide", reward=False) if phase == "memory" else main_ex
        undo = _inject(phase, args.rank, ex.reference_model)
        before = rss_bytes()
        outputs = serve_calls(ex, comm, calls)
        undo()
        seen[phase] = {"rss_before": before, "outputs": outputs}
    comm.close()
    Path(args.out).write_bytes(pickle.dumps(seen))
    # gloo's threads are not joined at interpreter exit: its static destructors may then abort
    # ("terminate called without an active exception", exit -6) after the work is done
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
