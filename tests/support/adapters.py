"""A tiny base model on disk and PEFT LoRA adapters saved next to it (fixed seeds), and the float64
naive reference: the merged weights ``W + scale * B @ A`` in a float64 copy of the base.

Plain functions (no fixtures). ``write_fleet(tmp)`` lays out what a worker with
``--reference-model base --adapter-root adapters --model-root models`` reads.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tests.support.models import tiny_causal

TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")
ADAPTERS = ("run42/step-120", "run42/step-240", "other")


def save_lora(
    base: nn.Module,
    path: Path,
    seed: int,
    *,
    rank: int = 4,
    alpha: int = 8,
    targets: tuple[str, ...] = TARGETS,
) -> None:
    """A PEFT LoRA adapter of ``base`` with random nonzero A and B (seed ``seed``) at ``path``,
    on the modules named ``targets``."""
    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(base)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0)
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    # lm_head in targets: PEFT would also save the full head weight (an embedding-like layer);
    # the worker reads LoRA A/B tensors only
    peft_model.save_pretrained(str(path), save_embedding_layers=False)


def write_fleet(root: Path, *, versions: int = 2) -> dict[str, Path]:
    """``root/base`` (tiny llama, seed 0), three adapters under ``root/adapters`` (seeds 1..3),
    and ``root/models/step-N`` full checkpoints (seeds 10+N)."""
    base = tiny_causal("llama", seed=0)
    base.save_pretrained(str(root / "base"))
    for i, name in enumerate(ADAPTERS):
        save_lora(base, root / "adapters" / name, seed=i + 1)
    for n in range(versions):
        tiny_causal("llama", seed=10 + n).save_pretrained(str(root / "models" / f"step-{n}"))
    return {"base": root / "base", "adapters": root / "adapters", "models": root / "models"}


def merged_float64(base: nn.Module, adapter_dir: Path) -> nn.Module:
    """A float64 copy of ``base`` with the adapter merged into its weights, by hand."""
    import json

    from safetensors.torch import load_file

    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    model = copy.deepcopy(base).double()
    modules = dict(model.named_modules())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            name = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            scale = cfg["lora_alpha"] / a.shape[0]
            modules[name].weight += scale * (b.double() @ a.double())  # [out, in]
    return model


def naive_logps(model: nn.Module, tokens: np.ndarray, prompt_len: int) -> np.ndarray:
    """log_softmax(model(tokens).logits) gathered at the completion tokens, float64."""
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))[None]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].double()  # [L, V]
    logps = torch.log_softmax(logits, dim=-1)
    pos = torch.arange(prompt_len, ids.shape[1])
    return logps[pos - 1, ids[0, pos]].numpy()
