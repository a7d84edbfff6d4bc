"""The torch side of the GPU check: random-weight Llama models, ragged RL inputs, the naive
in-trainer loop, parameter counts and timing / peak-memory helpers. Shapes, the bf16 peak table and
the FLOP count are data in ``shapes``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from worker.demo.tiny import llama_config, random_model
from worker.devtools.gpu_check.shapes import SEED, GroupSet, Shape
from worker.executor import SequenceInput


def build_model(shape: Shape, device: str, dtype: str) -> Any:
    """``LlamaForCausalLM`` with random weights (seed ``SEED``), initialised on ``device``."""
    config = llama_config(
        shape.vocab_size,
        shape.hidden_size,
        shape.intermediate_size,
        shape.max_position_embeddings,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        tie_word_embeddings=False,
    )
    model = random_model("LlamaForCausalLM", config, SEED, device=device)
    return model.to(getattr(torch, dtype)).eval()


def ragged_inputs(shape: Shape, n: int | None = None) -> list[SequenceInput]:
    """``n`` (default ``shape.sequences``) prompt + completion sequences, fixed seed."""
    rng = np.random.default_rng(SEED)
    out = []
    for _ in range(shape.sequences if n is None else n):
        prompt = int(rng.integers(shape.prompt_tokens[0], shape.prompt_tokens[1] + 1))
        completion = int(rng.integers(shape.completion_tokens[0], shape.completion_tokens[1] + 1))
        tokens = rng.integers(0, shape.vocab_size, prompt + completion)
        out.append(SequenceInput(tokens, prompt_len=prompt))
    return out


def group_inputs(gset: GroupSet, vocab: int, seed: int = SEED) -> list[SequenceInput]:
    """The sequences of ``gset``, group by group, random ids in ``[0, vocab)``: a group's
    sequences share its prompt (each its own prompt without ``gset.shared``), and its
    completions start with distinct ids, so the longest prefix a group shares is its prompt."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(gset.groups):
        prompt = rng.integers(0, vocab, gset.prompt_tokens)
        firsts = rng.choice(vocab, size=gset.completions, replace=False)
        for first in firsts:
            own = prompt if gset.shared else rng.integers(0, vocab, gset.prompt_tokens)
            completion = rng.integers(0, vocab, gset.completion_tokens)
            completion[0] = first
            out.append(SequenceInput(np.concatenate([own, completion]), prompt_len=len(own)))
    return out


def token_counts(seqs: Sequence[SequenceInput]) -> dict[str, int]:
    """Real (unpadded) tokens, scored tokens and ``sum(T**2)`` of a batch."""
    lengths = [len(s.tokens) for s in seqs]
    return {
        "sequences": len(seqs),
        "real_tokens": sum(lengths),
        "scored_tokens": sum(
            n - int(s.prompt_len or 0) for n, s in zip(lengths, seqs, strict=True)
        ),
        "sum_sq_tokens": sum(n * n for n in lengths),
    }


@torch.inference_mode()
def naive_logps(
    model: torch.nn.Module, seqs: Sequence[SequenceInput], batch: int, width: int = 0
) -> list[Any]:
    """The in-trainer baseline on the model's device, ``batch`` sequences at a time in arrival
    order: right-pad (to the batch's longest, or to ``width`` if longer: one shape for every
    batch, so a compiled attention kernel compiles once), full logits in float32,
    ``log_softmax``, ``gather``, keep the completion. The same computation as
    ``worker.devtools.bench.executor.naive_logps`` (which runs on CPU only)."""
    device = next(model.parameters()).device
    out: list[Any] = []
    for start in range(0, len(seqs), batch):
        group = seqs[start : start + batch]
        cols = max(width, *(len(s.tokens) for s in group))
        ids = torch.zeros(len(group), cols, dtype=torch.long)  # [B, T]
        attn = torch.zeros_like(ids)  # [B, T]
        for i, s in enumerate(group):
            ids[i, : len(s.tokens)] = torch.as_tensor(np.asarray(s.tokens))
            attn[i, : len(s.tokens)] = 1
        ids, attn = ids.to(device), attn.to(device)
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits.float()
        logps = torch.log_softmax(logits[:, :-1], dim=-1)  # [B, T-1, V]
        picked = logps.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
        del logits, logps
        for i, s in enumerate(group):
            out.append(picked[i, int(s.prompt_len or 1) - 1 : len(s.tokens) - 1].cpu().numpy())
    return out


def _worst_pair(a: Sequence[Any], b: Sequence[Any], reduce: Any) -> float:
    """The largest ``reduce(|x - y|)`` over paired log-prob arrays (``inf`` when a pair's
    lengths differ; empty pairs count 0)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        if x.shape != y.shape:
            return float("inf")
        if x.size:
            worst = max(worst, float(reduce(np.abs(x - y))))
    return worst


def max_abs_diff(a: Sequence[Any], b: Sequence[Any]) -> float:
    """Largest ``|a - b|`` over paired log-prob arrays (``inf`` when a pair's lengths differ)."""
    return _worst_pair(a, b, np.max)


def max_mean_abs_diff(a: Sequence[Any], b: Sequence[Any]) -> float:
    """The largest per-pair mean ``|a - b|`` over paired log-prob arrays (``inf`` when a pair's
    lengths differ): a small error on every token of a sequence, which a max bound misses."""
    return _worst_pair(a, b, np.mean)


def param_counts(model: Any) -> dict[str, int]:
    """Parameters: total, input embedding, LM head, and the body (everything else)."""
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    head_module = model.get_output_embeddings()
    head = head_module.weight.numel() if head_module is not None else 0
    return {"total": total, "embedding": embed, "lm_head": head, "body": total - embed - head}


def synchronize(device: str) -> None:
    """Wait for queued CUDA work (no-op on CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_peak(device: str, fn: Callable[[], Any]) -> tuple[int | None, Any]:
    """``(peak bytes allocated by torch during fn, its output)``; ``None`` on CPU."""
    if not device.startswith("cuda"):
        return None, fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated()), out


def best_times(
    sides: dict[str, Callable[[], Any]], device: str, repeats: int
) -> dict[str, list[float]]:
    """Wall seconds of ``repeats`` interleaved runs of each side (so all see the same load)."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - t0)
    return times
