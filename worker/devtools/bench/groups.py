"""A quick measurement of prefix sharing: one GRPO-shaped call (a prompt of P tokens, G
completions of C tokens) scored with ``prefix_sharing`` on and off, in one process, on a tiny
random Llama (no download). Prints the best-of-N time of each and the tokens through the backbone.

``scoring-worker bench --suite groups`` (or ``python -m worker.devtools.bench.groups --shape
256,8,32 --rounds 3``): in process, no Redis; the shapes are small stand-ins for (1024, 8, 128); a
shared machine makes the times noisy.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print one line per setting."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="256,8,32", help="P,G,C")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a smaller shape (a smoke run)")
    args = parser.parse_args(argv)
    p, g, c = (int(x) for x in ("64,4,8" if args.quick else args.shape).split(","))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=4096, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=p + c + 8,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 4096, p).tolist()
    seqs = [
        SequenceInput(prompt + rng.integers(0, 4096, c).tolist(), prompt_len=p) for _ in range(g)
    ]
    print(f"P={p} G={g} C={c}: {g * (p + c)} tokens, {p + g * c} unique")
    for sharing in ("off", "auto"):
        ex = StatelessExecutor(ExecutorConfig(prefix_sharing=sharing), model)
        ex.score(seqs)  # warm-up
        best = float("inf")
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            out = ex.score(seqs)
            best = min(best, time.perf_counter() - t0)
        m = out.metrics
        print(
            f"prefix_sharing={sharing:4s} best {best * 1000:8.1f} ms  forward_tokens="
            f"{m.forward_tokens}  shared_prefix_tokens={m.shared_prefix_tokens}  "
            f"({ex.info['prefix_sharing']})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
