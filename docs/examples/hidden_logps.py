"""Turn a worker's ``hidden`` rows into its log-probs (docs/distillation.md, *Hidden states*).

A job with ``outputs=("hidden", ...)`` gets, per scored position, the vector the LM head reads
(after the final norm), and in its result's ``info["head"]`` what the worker does after the
head: ``weight`` (and ``tied``: the input embedding it shares its weight with; a checkpoint
stores one of the two names), ``bias``, ``logit_scale``, ``logits_divisor``, ``softcap`` and
``temperature``. ``load_head`` reads the head from the same checkpoint the worker serves;
``logits_from_hidden`` applies it exactly as the worker does, so a full-vocabulary loss
(forward KL over all V, JSD, ...) can run in the trainer on ``H`` numbers per token instead of
``V``. ``token_logps`` is the worker's ``logps`` from them.

Needs torch and safetensors (the trainer's side); no worker code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


def _tensor(root: Path, name: str | None) -> torch.Tensor | None:
    """The tensor ``name`` of a safetensors checkpoint directory (sharded or not), or None."""
    if not name:
        return None
    index = root / "model.safetensors.index.json"
    if index.exists():
        file = json.loads(index.read_text())["weight_map"].get(name)
        if file is None:
            return None
        path = root / file
    else:
        path = root / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name) if name in f.keys() else None  # noqa: SIM118


def load_head(checkpoint: str | Path, head: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    """``(weight [V, H], bias [V] or None)`` of the LM head ``head`` (a result's
    ``info["head"]``) from the checkpoint directory the worker serves."""
    root = Path(checkpoint)
    weight = _tensor(root, head["weight"])
    if weight is None:  # tied: the checkpoint keeps the embedding's name only
        weight = _tensor(root, head.get("tied"))
    if weight is None:
        raise KeyError(f"neither {head['weight']!r} nor {head.get('tied')!r} in {root}")
    return weight, _tensor(root, head.get("bias"))


def logits_from_hidden(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Any, head: dict[str, Any]
) -> torch.Tensor:
    """The worker's logits ``[n, V]`` (float32, after its transforms and ``/ temperature``)
    from ``hidden`` rows ``[n, H]``."""
    z = hidden.float() @ weight.float().T  # [n, V]
    if bias is not None:
        z += bias.float()
    if head.get("logit_scale") is not None:  # Cohere
        z *= head["logit_scale"]
    if head.get("logits_divisor") is not None:  # Granite
        z /= head["logits_divisor"]
    if head.get("softcap") is not None:  # Gemma 2/3
        z = head["softcap"] * torch.tanh(z / head["softcap"])
    return z / head.get("temperature", 1.0)


def token_logps(
    hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias: Any, head: dict
) -> torch.Tensor:
    """``log_softmax(logits)[label]`` per row ``[n]``: the worker's ``logps``."""
    logps = torch.log_softmax(logits_from_hidden(hidden, weight, bias, head), dim=-1)
    return logps.gather(-1, labels.long()[:, None]).squeeze(-1)
