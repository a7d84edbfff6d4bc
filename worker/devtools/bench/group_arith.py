"""The arithmetic of group scoring with prefix sharing on GPU-sized models:
``python -m worker.devtools.bench.group_arith [--json PATH]`` prints the tables of
docs/performance.md ("Group scoring on GPU shapes: the arithmetic"). Nothing is measured.

A group is one prompt of ``P`` tokens and ``G`` completions of ``C`` tokens each, every
completion token scored. Per group, per-sequence scoring (``prefix_sharing="off"``) against
tree rows (``"auto"``), on a Llama-shaped model (``ModelShape``):

* backbone tokens: ``G (P + C)`` against ``P + G C``;
* linear-layer FLOPs: ``2 * linear_params * tokens`` (``linear_params``: every matmul weight of
  the layers, embedding and LM head excluded; norms do no matmul);
* LM-head FLOPs: ``2 * hidden * vocab * G C`` on both sides (only scored positions read the head);
* attention FLOPs (``QK^T`` and ``PV``, ``2 * hidden`` each per query-key pair and layer) over the
  causal pairs: ``G (P + C)^2 / 2`` per sequence against ``P^2 / 2 + G C (P + C / 2)`` in tree
  rows (the prompt's pairs once; each completion against the prompt and its own earlier tokens);
* attention K/V bytes read in bfloat16, at the model's KV-head width (a GQA-aware kernel reading
  each attended sequence's keys and values once): ``G (P + C)`` tokens per sequence; tree rows as
  ``worker/executor/tree/attention.py`` runs them, ``P + G (P + C)`` (the prefix block, then each
  continuation against its own copy of the prompt's K/V) and ``H / Hkv`` times that as the SDPA
  kernel reads them there (``_repeat_kv`` expands K/V to every query head first); a cascade
  kernel that reads the prompt's K/V once for all continuations, ``P + G C``.

Naive equivalent of the FLOP count: ``gpu_check.shapes.useful_flops`` (the same terms for one
ragged batch, per sequence).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BF16_BYTES = 2
#: H200 SXM: dense bfloat16 peak (``gpu_check.shapes.DEVICE_PEAKS``) and HBM3e bandwidth, from
#: NVIDIA's H200 datasheet; used only to put FLOPs and bytes on one scale of time.
H200_FLOPS = 989.4e12
H200_BYTES_PER_S = 4.8e12


@dataclass(frozen=True)
class ModelShape:
    """A Llama-shaped decoder: layers, hidden size, query and KV heads, MLP width, vocabulary."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    @property
    def linear_params(self) -> int:
        """Matmul weights of the layers: q and o (``hidden^2`` each), k and v (``hidden * kv_heads
        * head_dim`` each), the gated MLP (``3 * hidden * ffn``), times the layers."""
        kv = self.kv_heads * self.head_dim
        return self.layers * (
            2 * self.hidden**2 + 2 * self.hidden * kv + 3 * self.hidden * self.ffn
        )

    @property
    def head_params(self) -> int:
        """The LM head (untied or not, it is read once per scored position)."""
        return self.hidden * self.vocab

    def kv_bytes_per_token(self, dtype_bytes: int = BF16_BYTES) -> int:
        """Bytes of one token's keys and values over every layer, at the KV-head width."""
        return 2 * self.kv_heads * self.head_dim * dtype_bytes * self.layers


@dataclass(frozen=True)
class GroupShape:
    """One prompt of ``prompt`` tokens and ``completions`` completions of ``completion`` tokens."""

    prompt: int
    completions: int
    completion: int

    def label(self) -> str:
        """``(P, G, C)``."""
        return f"({self.prompt}, {self.completions}, {self.completion})"


LLAMA3_8B = ModelShape("Llama-3-8B-like", 32, 4096, 32, 8, 14336, 128_256)
LLAMA3_70B = ModelShape("Llama-3-70B-like", 80, 8192, 64, 8, 28672, 128_256)
MODELS = (LLAMA3_8B, LLAMA3_70B)
GROUPS = (
    GroupShape(1024, 8, 128),
    GroupShape(2048, 8, 512),
    GroupShape(4096, 16, 512),
    GroupShape(256, 16, 1024),
)


def tokens(g: GroupShape) -> dict[str, int]:
    """Backbone tokens of one group: every sequence in full, and tree rows."""
    p, n, c = g.prompt, g.completions, g.completion
    return {"per_sequence": n * (p + c), "tree": p + n * c}


def attention_pairs(g: GroupShape) -> dict[str, float]:
    """Causal query-key pairs of one group (the continuous ``L^2 / 2`` count)."""
    p, n, c = g.prompt, g.completions, g.completion
    return {"per_sequence": n * (p + c) ** 2 / 2, "tree": p**2 / 2 + n * c * (p + c / 2)}


def kv_tokens(g: GroupShape) -> dict[str, int]:
    """Tokens whose K/V the attention reads, per layer, at the KV-head width."""
    p, n, c = g.prompt, g.completions, g.completion
    return {"per_sequence": n * (p + c), "tree": p + n * (p + c), "cascade": p + n * c}


def costs(m: ModelShape, g: GroupShape) -> dict[str, Any]:
    """Every figure of one model and group shape (module docstring), per group."""
    tok, pairs, kv = tokens(g), attention_pairs(g), kv_tokens(g)
    scored = g.completions * g.completion
    head = 2 * m.head_params * scored
    linear = {k: 2 * m.linear_params * t for k, t in tok.items()}
    attention = {k: 4 * m.hidden * m.layers * n for k, n in pairs.items()}
    total = {k: linear[k] + head + attention[k] for k in tok}
    per_token = m.kv_bytes_per_token()
    kv_bytes = {k: n * per_token for k, n in kv.items()}
    kv_bytes["tree_expanded"] = kv_bytes["tree"] * m.heads // m.kv_heads
    terms = {
        "linear": linear["per_sequence"],
        "lm_head": head,
        "attention": attention["per_sequence"],
    }
    return {
        "model": m.name,
        "group": asdict(g),
        "tokens": tok,
        "scored_tokens": scored,
        "linear_flops": linear,
        "head_flops": head,
        "attention_flops": attention,
        "total_flops": total,
        "flop_ratio": total["per_sequence"] / total["tree"],
        "linear_share": {k: linear[k] / total[k] for k in tok},
        "attention_share": {k: attention[k] / total[k] for k in tok},
        "dominant_per_sequence": max(terms, key=lambda k: terms[k]),
        "kv_bytes": kv_bytes,
        "kv_ratio": {k: kv_bytes["per_sequence"] / v for k, v in kv_bytes.items()},
    }


def table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The markdown tables: FLOPs per group, then K/V bytes per group."""
    t = 1e12
    out = [
        "| model | (P, G, C) | backbone tokens off / tree | linear TFLOP off / tree | "
        "LM head TFLOP | attention TFLOP off / tree | total TFLOP off / tree | ratio | "
        "attention share off / tree |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        g = GroupShape(**r["group"])
        lin, att, tot = r["linear_flops"], r["attention_flops"], r["total_flops"]
        share = r["attention_share"]
        cells = [
            f"{r['tokens']['per_sequence']:,} / {r['tokens']['tree']:,}",
            f"{lin['per_sequence'] / t:,.1f} / {lin['tree'] / t:,.1f}",
            f"{r['head_flops'] / t:.2f}",
            f"{att['per_sequence'] / t:,.2f} / {att['tree'] / t:,.2f}",
            f"{tot['per_sequence'] / t:,.1f} / {tot['tree'] / t:,.1f}",
            f"{r['flop_ratio']:.2f}x",
            f"{100 * share['per_sequence']:.1f}% / {100 * share['tree']:.1f}%",
        ]
        out.append(f"| {r['model']} | {g.label()} | " + " | ".join(cells) + " |")
    mib = 2**20
    out += [
        "",
        "| model | (P, G, C) | K/V MiB off | tree as implemented | tree, K/V expanded to H "
        "heads | cascade bound (prompt once) | off at H200 peaks: K/V ms / FLOP ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        g = GroupShape(**r["group"])
        kv, ratio = r["kv_bytes"], r["kv_ratio"]
        cells = [
            f"{kv[k] / mib:,.0f} ({ratio[k]:.2f}x)" for k in ("tree", "tree_expanded", "cascade")
        ]
        kv_ms = 1e3 * kv["per_sequence"] / H200_BYTES_PER_S
        flop_ms = 1e3 * r["total_flops"]["per_sequence"] / H200_FLOPS
        cells.append(f"{kv_ms:.2f} / {flop_ms:,.0f}")
        out.append(
            f"| {r['model']} | {g.label()} | {kv['per_sequence'] / mib:,.0f} | "
            + " | ".join(cells)
            + " |"
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Print the tables (``--json PATH``: also every figure)."""
    p = argparse.ArgumentParser(prog="group_arith", description=__doc__.splitlines()[0])
    p.add_argument("--json", dest="json_path", help="also write every figure as JSON here")
    args = p.parse_args(argv)
    rows = [costs(m, g) for m in MODELS for g in GROUPS]
    print("\n".join(table(rows)))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
