"""Vision-language group scoring end to end: GRPO-shaped image jobs through Redis to three
``serve`` workers in one run: ``alone`` (``--prefix-sharing off --image-sharing off``: every
sequence computed alone, its images included), ``off`` (``--prefix-sharing off``: each distinct
image once through the tower, every sequence's tokens in full) and ``auto`` (prompt and images
shared).

``scoring-worker bench --suite vision`` (or ``python -m worker.devtools.bench.vision``)
``[--arch A] [--groups N] [--rounds R] [--threads T] [--redis-url URL] [--json PATH]
[--quick]``.
The models (``--arch``, default both): a random-weight Qwen2.5-VL and SmolVLM of about 250M
parameters each, built from a config (no VLM weights are needed: the cost of a forward does not
depend on the weights' values) and saved with its image processor; ``--quick``: small ones (a
smoke run). SmolVLM runs with image splitting off (one 512 x 512 tile, 64 image tokens).
Without ``--redis-url`` an embedded Valkey is started.

Workloads, each group ONE job carrying its images once and its prompt once (``prefix``):

- ``grpo``: one 448 x 448 image and 64 text tokens of prompt (the image is 256 image tokens
  between its vision start and end), G = 8 completions of C = 128;
- ``agent``: the same prompt, then per rollout 64 tokens, a tool image (224 x 224, 64 image
  tokens, its own per rollout) returned in a later turn, and 64 more tokens (its image tokens are
  never scored).

Per workload the three workers are started fresh, warmed with one pass, then ``--rounds``
passes rotate over them; the median pass is reported. Columns: tokens (total, unique: the bound
of the text alone), the FLOP bounds of sharing against ``off`` and ``alone``, backbone tokens
per pass (``scoring_forward_tokens_total``), vision-tower images per pass
(``scoring_vision_tower_images_total``), wall time first ``XADD`` to last result, speed-ups
off / on and alone / on, peak RSS (``VmHWM``, model load included).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from worker.demo.embedded import redis_url_or_embedded
from worker.demo.tiny import VLM_TOKENS, random_model
from worker.devtools.bench.groups import Side, counter
from worker.devtools.machine import this_machine
from worker.protocol import encode_job
from worker.request import Images

START, END, IMAGE = (
    VLM_TOKENS["vision_start_token_id"],
    VLM_TOKENS["vision_end_token_id"],
    VLM_TOKENS["image_token_id"],
)
G, C, TEXT, SIDE, TOOL, SMOL_SIDE = 8, 128, 64, 448, 224, 512
ARCHS = ("qwen2_5_vl", "smolvlm")
# each side: its --prefix-sharing and further serve flags
SIDES: dict[str, tuple[str, tuple[str, ...]]] = {
    "alone": ("off", ("--image-sharing", "off")),
    "off": ("off", ()),
    "auto": ("auto", ()),
}


def image_bytes(side: int, seed: int) -> bytes:
    """A random ``side x side`` RGB JPEG."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(side, side, 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


@dataclass(frozen=True)
class Costs:
    """Multiply-adds of the model, from its parameter counts: per token through the language
    model's layers (``backbone``), per scored token in the LM head (``head``), per patch
    through the vision tower and its projector (``patch``)."""

    params: int
    backbone: float
    head: float
    patch: float


def build_model(directory: Path, arch: str, *, small: bool) -> tuple[str, Costs]:
    """A random ``arch`` (``qwen2_5_vl`` or ``smolvlm``, about 250M parameters; ``small``: a
    smoke-run size) and its image processor saved in ``directory``; returns the path and its
    ``Costs``."""
    model, processor = _smolvlm(small) if arch == "smolvlm" else _qwen2_5_vl(small)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    inner = model.model
    towers = [getattr(inner, n, None) for n in ("visual", "vision_model", "connector")]
    vision = sum(p.numel() for t in towers if t is not None for p in t.parameters())
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    backbone = total - vision - embed - (0 if tied else head)
    return str(directory), Costs(total, float(backbone), float(head), float(vision))


def _qwen2_5_vl(small: bool) -> tuple[Any, Any]:
    """Qwen2.5-VL in the proportions of the released 3B: a 14-layer text model of width 1024
    (tied embeddings) and an 8-layer vision tower of width 640 (448 x 448: 256 image tokens)."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    # the proportions of the released 3B: a tower of about a fifth of the language model
    width, layers, vision_width, vision_layers = (64, 2, 64, 2) if small else (1024, 14, 640, 8)
    text = {
        "vocab_size": 32000, "hidden_size": width, "intermediate_size": width * 11 // 4,
        "num_hidden_layers": layers, "num_attention_heads": width // 64,
        "num_key_value_heads": max(1, width // 256), "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "mrope_section": [8, 12, 12],
                            "rope_theta": 1000000.0},
    }  # fmt: skip
    vision = {
        "depth": vision_layers, "hidden_size": vision_width, "num_heads": vision_width // 64,
        "intermediate_size": vision_width * 4, "out_hidden_size": width, "patch_size": 14,
        "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
        "fullatt_block_indexes": [vision_layers // 2 - 1, vision_layers - 1],
    }  # fmt: skip
    config: Any = cast(Any, Qwen2_5_VLConfig)(
        text_config=text, vision_config=vision, tie_word_embeddings=True, **VLM_TOKENS
    )
    pixels = 28 * 28
    processor = Qwen2VLImageProcessorPil(
        patch_size=14, min_pixels=4 * pixels, max_pixels=256 * pixels
    )
    return random_model("Qwen2_5_VLForConditionalGeneration", config, 0), processor


def _smolvlm(small: bool) -> tuple[Any, Any]:
    """SmolVLM: SmolLM2-135M's shape (30 layers of width 576) and a 12-layer SigLIP of width
    768 on 512 x 512 images, pixel shuffle by 4 (64 image tokens), image splitting off."""
    from transformers import SmolVLMConfig
    from transformers.models.smolvlm.image_processing_pil_smolvlm import (
        SmolVLMImageProcessorPil,
    )

    width, layers, vision_width, vision_layers = (64, 2, 64, 2) if small else (576, 30, 768, 12)
    text = {
        "model_type": "llama", "vocab_size": 49152, "hidden_size": width,
        "intermediate_size": width * 8 // 3, "num_hidden_layers": layers,
        "num_attention_heads": width // 64, "num_key_value_heads": max(1, width // 192),
        "max_position_embeddings": 8192,
    }  # fmt: skip
    vision = {
        "hidden_size": vision_width, "intermediate_size": vision_width * 4,
        "num_hidden_layers": vision_layers, "num_attention_heads": vision_width // 64,
        "image_size": SMOL_SIDE, "patch_size": 16,
    }  # fmt: skip
    config: Any = SmolVLMConfig(
        text_config=text, vision_config=vision, scale_factor=4,
        image_token_id=VLM_TOKENS["image_token_id"],
    )  # fmt: skip
    edge = {"longest_edge": SMOL_SIDE}
    processor = SmolVLMImageProcessorPil(do_image_splitting=False, size=edge, max_image_size=edge)
    return random_model("SmolVLMForConditionalGeneration", config, 0), processor


def image_run(arch: str, side: int) -> list[int]:
    """The placeholder of a ``side x side`` image: Qwen2.5-VL's ``(side / 28)**2`` image
    tokens between vision start and end; SmolVLM's 64 (any size: resized to 512, one tile)
    between its image markers (the start and end ids stand for them)."""
    if arch == "smolvlm":
        return [START, END, *[IMAGE] * ((SMOL_SIDE // 16) ** 2 // 16), START]
    return [START, *[IMAGE] * ((side // 28) ** 2), END]


def patches(arch: str, side: int) -> int:
    """Vision-tower patches of a ``side x side`` image: Qwen's 14-pixel patches (a still image
    is one temporal patch), SmolVLM's 16-pixel ones of its 512 x 512 tile."""
    if arch == "smolvlm":
        return (SMOL_SIDE // 16) ** 2
    return (side // 14) ** 2


@dataclass
class VisionWorkload:
    """Jobs of one shape: per group its files, prompt and sequences (each with its images)."""

    name: str
    groups: list[tuple[list[bytes], list[int], list[tuple[list[int], list[int]]]]]
    unique: int
    scored: int  # completion tokens scored (image tokens never are)
    patches: int  # vision-tower patches of the distinct images
    every_patch: int  # vision-tower patches of every sequence's images

    def flop_bound(self, costs: Costs, alone: bool = False) -> float:
        """Speed-up bound of sharing: every token through the backbone against the unique
        ones; the LM head (every scored token) the same on both sides, the vision tower each
        distinct image once (``alone``: every sequence's images on the unshared side)."""
        head = self.scored * costs.head
        tower = (self.every_patch if alone else self.patches) * costs.patch
        shared = self.unique * costs.backbone + head + self.patches * costs.patch
        return (self.total * costs.backbone + head + tower) / shared

    @property
    def total(self) -> int:
        """Tokens of every sequence, counted in full."""
        return sum(len(t) for _f, _p, seqs in self.groups for t, _r in seqs)

    def payloads(self, reply: str, tag: str, with_prefix: bool = True) -> list[bytes]:
        """One job per group: its images once, its prompt once (``prefix``)."""
        out = []
        for i, (files, prompt, seqs) in enumerate(self.groups):
            specs = [{"tokens": t, "prompt_len": len(prompt), "images": r} for t, r in seqs]
            prefix = prompt if with_prefix else None
            files_ = Images(tuple(files))
            out.append(
                encode_job(f"{tag}{i}", "reference", reply, specs, prefix=prefix, images=files_)
            )
        return out


def make_workloads(arch: str, n_groups: int, vocab: int, seed: int = 0) -> list[VisionWorkload]:
    """``grpo`` and ``agent`` (module docstring), ``n_groups`` jobs each."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    grpo, agent = [], []
    for g in range(n_groups):
        image = image_bytes(SIDE, seed=g)
        prompt = [*toks(TEXT // 2), *image_run(arch, SIDE), *toks(TEXT // 2)]
        grpo.append(([image], prompt, [(prompt + toks(C), [0]) for _ in range(G)]))
        tools = [image_bytes(TOOL, seed=1000 + g * G + k) for k in range(G)]
        rollouts = [
            (prompt + toks(C // 2) + image_run(arch, TOOL) + toks(C // 2), [0, 1 + k])
            for k in range(G)
        ]
        agent.append(([image, *tools], prompt, rollouts))
    p = len(grpo[0][1])
    tool = len(image_run(arch, TOOL))
    big, small = patches(arch, SIDE), patches(arch, TOOL)
    return [
        VisionWorkload(
            "grpo", grpo, n_groups * (p + G * C), n_groups * G * C, n_groups * big,
            n_groups * G * big,
        ),
        VisionWorkload(
            "agent", agent, n_groups * (p + G * (C + tool)), n_groups * G * C,
            n_groups * (big + G * small), n_groups * G * (big + small),
        ),
    ]  # fmt: skip


def run_workload(
    url: str, model: str, work: VisionWorkload, args: Any, tmp: Path
) -> dict[str, Any]:
    """The three workers fresh, one warm-up pass each, ``rounds`` passes rotating over them;
    the figures."""
    mbt = max(args.max_batch_tokens, max(sum(len(t) for t, _ in s) for _f, _p, s in work.groups))
    sides = {
        name: Side(
            url, mode, model, mbt, args.threads, tmp / f"{work.name}-{name}.log",
            extra=extra, name=name,
        )
        for name, (mode, extra) in SIDES.items()
    }  # fmt: skip
    names = list(SIDES)
    towers: dict[str, list[float]] = {m: [] for m in names}
    peaks: dict[str, float] = {}
    try:
        for side in sides.values():
            side.wait_up()
            side.one_pass(work, "warm")  # type: ignore[arg-type]
        for r in range(args.rounds):
            for m in names[r % len(names) :] + names[: r % len(names)]:
                before = counter(sides[m].metrics_url, "scoring_vision_tower_images_total")
                t, f = sides[m].one_pass(work, f"r{r}-")  # type: ignore[arg-type]
                after = counter(sides[m].metrics_url, "scoring_vision_tower_images_total")
                sides[m].times.append(t)
                sides[m].forward.append(f)
                towers[m].append(after - before)
    finally:
        for m, side in sides.items():
            peaks[m] = side.close()
    alone, off, on = (statistics.median(sides[m].times) for m in names)
    return {
        "workload": work.name,
        "groups": len(work.groups),
        "total_tokens": work.total,
        "unique_tokens": work.unique,
        "token_bound": work.total / work.unique,
        "flop_bound": work.flop_bound(args.costs),
        "flop_bound_alone": work.flop_bound(args.costs, alone=True),
        "forward_off": max(sides["off"].forward),
        "forward_on": max(sides["auto"].forward),
        "tower_images_alone": max(towers["alone"]),
        "tower_images_off": max(towers["off"]),
        "tower_images_on": max(towers["auto"]),
        "time_alone_s": alone,
        "time_off_s": off,
        "time_on_s": on,
        "speedup": off / on,
        "speedup_alone": alone / on,
        "peak_rss_off_mib": peaks["off"],
        "peak_rss_on_mib": peaks["auto"],
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    """The figures, one line per workload."""
    print(
        f"{'model':<12}{'workload':<10}{'total':>7}{'unique':>8}{'tokens':>7}{'flops':>6}"
        f"{'flops/a':>8}{'fwd off':>9}{'fwd on':>8}{'img a':>7}{'img off':>8}{'img on':>7}"
        f"{'alone s':>8}{'off s':>7}{'on s':>7}{'x':>6}{'x/a':>6}{'RSS off':>8}{'RSS on':>7}"
    )
    for r in rows:
        print(
            f"{r['model']:<12}{r['workload']:<10}{r['total_tokens']:>7}{r['unique_tokens']:>8}"
            f"{r['token_bound']:>7.2f}{r['flop_bound']:>6.2f}{r['flop_bound_alone']:>8.2f}"
            f"{r['forward_off']:>9.0f}{r['forward_on']:>8.0f}{r['tower_images_alone']:>7.0f}"
            f"{r['tower_images_off']:>8.0f}{r['tower_images_on']:>7.0f}"
            f"{r['time_alone_s']:>8.2f}{r['time_off_s']:>7.2f}{r['time_on_s']:>7.2f}"
            f"{r['speedup']:>6.2f}{r['speedup_alone']:>6.2f}{r['peak_rss_off_mib']:>8.0f}"
            f"{r['peak_rss_on_mib']:>7.0f}"
        )
    print(
        "tokens: total / unique tokens (the bound of the text alone); flops: the bound with the "
        "LM head and the vision tower (each distinct image once on both sides; flops/a: every "
        "sequence's images on the alone side); img: vision-tower images per pass (a: alone); "
        "x: off / on and x/a: alone / on median time; RSS: VmHWM in MiB"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run both workloads and print (and optionally write) the table."""
    p = argparse.ArgumentParser(prog="bench_vision", description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=2, help="groups (jobs) per workload")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--max-batch-tokens", type=int, default=16384)
    p.add_argument("--only", action="append", help="workload names to run (default: all)")
    p.add_argument("--redis-url", default=None, help="default: an embedded Valkey")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--quick", action="store_true", help="small models, 1 group, 1 round")
    p.add_argument("--arch", action="append", choices=ARCHS, help="models (default: both)")
    args, _ = p.parse_known_args(argv)
    if args.quick:
        args.groups, args.rounds = 1, 1
    rows = []
    sizes: dict[str, Costs] = {}
    with (
        redis_url_or_embedded(args.redis_url) as url,
        tempfile.TemporaryDirectory(prefix="bench-vision-") as tmp,
    ):
        for arch in args.arch or ARCHS:
            path, sizes[arch] = build_model(Path(tmp) / arch, arch, small=args.quick)
            args.costs = sizes[arch]
            vocab = 49152 if arch == "smolvlm" else 32000
            for work in make_workloads(arch, args.groups, vocab):
                if args.only and work.name not in args.only:
                    continue
                row = run_workload(url, path, work, args, Path(tmp))
                rows.append({"model": arch, **row})
                print(f"{arch} {work.name}: done", flush=True)
    models = ", ".join(f"{a} {c.params / 1e6:.0f}M parameters" for a, c in sizes.items())
    print(
        f"\nvision group scoring: random {models}, float32, {args.groups} groups per workload, "
        f"median of {args.rounds} rounds, --threads {args.threads}"
    )
    print(f"machine: {this_machine().describe()}")
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
