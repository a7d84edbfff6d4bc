"""``hidden`` rows: the vector the LM head reads at each scored position, and what a trainer
needs to turn it into this worker's logits (docs/distillation.md, *Hidden states*).

``BatchForward._logprobs`` takes the rows it already gathered for the head (``picked``, after the
final norm) and casts them to the job's ``hidden_dtype``; ``host_array`` brings them to numpy
(bfloat16 as its bits); ``head_info`` names the head's parameters and the logit transforms, once
per executor, for the result's ``info["head"]``. Naive equivalent of a row:
``model.model(ids).last_hidden_state[position]`` (``output_hidden_states=True``'s last entry).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from worker.executor.head.logprobs import LogitTransform
from worker.request import TokenOutputs

__all__ = ["HIDDEN_TORCH", "head_info", "head_request", "host_array"]

HIDDEN_TORCH = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
"""The torch dtype of each ``TokenOutputs.hidden_dtype``."""


def head_request(spec: TokenOutputs) -> TokenOutputs | None:
    """What the LM head computes for ``spec``: ``spec`` less ``"hidden"``; ``None`` when only
    ``"hidden"`` was asked (no head at all)."""
    if "hidden" not in spec.outputs:
        return spec
    rest = spec.outputs - {"hidden"}
    return replace(spec, outputs=rest, hidden_dtype="bfloat16") if rest else None


def host_array(value: torch.Tensor) -> np.ndarray:
    """A result tensor on the host as numpy; bfloat16 (no numpy dtype) as its bits, uint16."""
    if value.dtype == torch.bfloat16:
        return value.view(torch.int16).cpu().numpy().view(np.uint16)
    return value.cpu().numpy()


def head_info(model: Any, transform: LogitTransform | None) -> dict[str, Any] | None:
    """What turns ``hidden`` rows into ``model``'s logits: ``hidden_size``; ``weight``, the
    head's weight as the checkpoint names it, and ``tied``, the input embedding's name when the
    two share one tensor (a checkpoint stores one of them); ``bias`` (its name, or None); the
    transforms applied after the head (``logit_scale``, ``logits_divisor``, ``softcap``, each
    None when off). ``None`` without a causal LM."""
    if model is None:
        return None
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    prefix = next((f"{n}." for n, m in model.named_modules() if m is head), "")
    held = names.get(id(weight), []) if weight is not None else []
    own = [n for n in held if n.startswith(prefix)]
    other = [n for n in held if n not in own]
    bias = getattr(head, "bias", None)
    transform = transform or LogitTransform()
    size = getattr(head, "in_features", None)
    if not isinstance(size, int):
        size = int(getattr(model.config, "hidden_size", 0) or 0)
    return {
        "hidden_size": size,
        "weight": own[0] if own else (held[0] if held else None),
        "tied": other[0] if other and own else None,
        "bias": next(iter(names.get(id(bias), [])), None) if bias is not None else None,
        "logit_scale": transform.scale,
        "logits_divisor": transform.divisor,
        "softcap": transform.softcap,
    }
