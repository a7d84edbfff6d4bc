"""LoRA adapters on a shared base: read a PEFT adapter directory, apply it per call via hooks.

An adapter directory is what ``peft``'s ``save_pretrained`` writes: ``adapter_config.json``
(``peft_type: LORA``, ``r``, ``lora_alpha``, ``use_rslora``, ``rank_pattern``,
``alpha_pattern``) and ``adapter_model.safetensors`` with keys
``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``.
Pickled ``adapter_model.bin`` files are never read (no code runs from a job's name).

The base model's weights are never modified. ``LoraHooks`` puts one forward hook on every linear
layer of a served model (once, at construction: hooks are never added while forwards run); the
hook reads the adapter active in the calling context (``active``, a ``ContextVar``) and adds
``scale * (x @ A.T) @ B.T`` to the layer's output (``apply_delta``: one in-place ``addmm_``).
With no adapter active the hook returns ``None`` and the output is exactly the base model's.
Naive equivalent: the merged weight ``W + scale * B @ A`` (``tests/executor/test_adapters.py``
asserts they agree in float64).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import struct
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker.errors import BadRequest, ModelNotFound

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class LoraDelta:
    """One adapted layer: ``output += scale * (x @ a.T) @ b.T``."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float


@dataclass(frozen=True)
class LoraAdapter:
    """A loaded adapter: its deltas by module name (relative to the served model)."""

    name: str
    deltas: dict[str, LoraDelta]
    nbytes: int
    fingerprint: str


_ACTIVE: ContextVar[LoraAdapter | None] = ContextVar("scoring_lora_adapter", default=None)


@contextlib.contextmanager
def active(adapter: LoraAdapter | None) -> Iterator[None]:
    """Run the block's forwards (in this thread/context) with ``adapter`` applied."""
    token = _ACTIVE.set(adapter)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _adaptable(module: nn.Module) -> bool:
    """A linear layer LoRA can adapt (``nn.Linear``, or GPT-2's ``Conv1D``)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


class LoraHooks:
    """Forward hooks on every linear layer of ``models``; they apply the active adapter."""

    def __init__(self, models: list[nn.Module]) -> None:
        self._handles: list[Any] = []
        #: Adaptable module names of the first model, with their (in, out) features.
        self.shapes: dict[str, tuple[int, int]] = {}
        for i, model in enumerate(models):
            for name, module in model.named_modules():
                if not _adaptable(module):
                    continue
                self._handles.append(module.register_forward_hook(_hook_for(name)))
                if i == 0:
                    self.shapes[name] = _features(module)

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _features(module: nn.Module) -> tuple[int, int]:
    weight: Any = module.weight  # Linear: [out, in]; Conv1D: [in, out]
    if isinstance(module, nn.Linear):
        return int(weight.shape[1]), int(weight.shape[0])
    return int(weight.shape[0]), int(weight.shape[1])


def _hook_for(name: str) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        adapter = _ACTIVE.get()
        if adapter is None:  # the base: nothing added, not even a copy
            return None
        delta = adapter.deltas.get(name)
        if delta is None:
            return None
        return apply_delta(delta, args[0], output)

    def idle() -> bool:
        """Whether the hook adds nothing in this context (no adapter, or none for ``name``):
        ``tiles.tileable`` may then cut the layer into vocabulary tiles around it."""
        adapter = _ACTIVE.get()
        return adapter is None or name not in adapter.deltas

    hook.idle = idle  # type: ignore[attr-defined]
    return hook


def apply_delta(delta: LoraDelta, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor | None:
    """``output + scale * (x @ a.T) @ b.T``; in place (returns ``None``) when it can be.

    In place: one ``addmm_`` into the layer's fresh output (``[N, out] += scale * [N, r] @ [r,
    out]``), no ``[N, out]`` temporaries. Otherwise (dtypes differ, a non-contiguous output, or
    an output autograd needs) the out-of-place naive form, returned.
    """
    a, b = delta.a, delta.b  # [r, in], [out, r]
    if (
        x.dtype == a.dtype == output.dtype
        and output.is_contiguous()
        and not (output.requires_grad and torch.is_grad_enabled())
    ):
        low = x.reshape(-1, x.shape[-1]) @ a.T  # [N, r]
        output.view(-1, output.shape[-1]).addmm_(low, b.T, alpha=delta.scale)  # [N, out]
        return None
    low = (x.to(a.dtype) @ a.T) @ b.T  # [..., out]
    return output + (delta.scale * low).to(output.dtype)


def fingerprint(directory: Path, files: list[str], *, full: bool = True) -> str:
    """sha256 (16 hex) of the named files, in order.

    ``full``: every byte (adapters: megabytes). Otherwise (full checkpoints: gigabytes) each
    safetensors file contributes its size, its header (names, dtypes, shapes, offsets) and the
    first and last MiB of its data; other files (JSON configs) every byte.
    """
    digest = hashlib.sha256()
    for fname in files:
        path = directory / fname
        digest.update(fname.encode())
        if full or not fname.endswith(".safetensors"):
            with path.open("rb") as fh:
                while block := fh.read(1 << 20):
                    digest.update(block)
            continue
        size = path.stat().st_size
        digest.update(str(size).encode())
        with path.open("rb") as fh:
            head = fh.read(8)
            (header,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
            digest.update(fh.read(min(header, 100 << 20)))
            digest.update(fh.read(1 << 20))
            fh.seek(max(size - (1 << 20), 0))
            digest.update(fh.read(1 << 20))
    return digest.hexdigest()[:16]


def read_config(directory: Path) -> dict[str, Any]:
    """The adapter's config; ``ModelNotFound`` without one, ``BadRequest`` if not a plain LoRA."""
    path = directory / CONFIG_FILE
    if not path.is_file() or not (directory / WEIGHTS_FILE).is_file():
        raise ModelNotFound(f"no {CONFIG_FILE} + {WEIGHTS_FILE} in adapter {directory.name!r}")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BadRequest(f"adapter config {directory.name!r} does not parse: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise BadRequest(f"adapter {directory.name!r}: only peft_type LORA is served")
    for unsupported in ("use_dora", "modules_to_save", "lora_bias", "layers_to_transform"):
        if config.get(unsupported):
            raise BadRequest(f"adapter {directory.name!r}: {unsupported} is not supported")
    return config


def _pattern(patterns: Any, module: str, default: float) -> float:
    """peft's ``rank_pattern``/``alpha_pattern`` lookup: a key matches a module name suffix."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return float(value)
    return default


def load_lora(
    name: str,
    directory: Path,
    shapes: dict[str, tuple[int, int]],
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> LoraAdapter:
    """Read ``directory`` (see the module docstring) into a ``LoraAdapter`` on ``device``.

    Every adapted module must be a linear layer of the served model with matching shapes
    (``BadRequest`` otherwise): an adapter trained for another base never runs silently.
    """
    from safetensors import safe_open

    config = read_config(directory)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(directory / WEIGHTS_FILE), framework="pt", device="cpu") as fh:
        for key in fh.keys():  # noqa: SIM118 (safe_open has no __iter__)
            bare = key.removeprefix(_PREFIX)
            match = _KEY.match(bare)
            if match is None:
                raise BadRequest(f"adapter {name!r}: unexpected tensor {key!r}")
            parts.setdefault(match["module"], {})[match["part"]] = fh.get_tensor(key)
    if not parts:
        raise BadRequest(f"adapter {name!r} holds no LoRA tensors")
    alpha = float(config.get("lora_alpha", 8))
    deltas: dict[str, LoraDelta] = {}
    nbytes = 0
    for module, ab in parts.items():
        if set(ab) != {"A", "B"} or module not in shapes:
            raise BadRequest(f"adapter {name!r} does not fit the served model at {module!r}")
        a, b = ab["A"], ab["B"]
        rank = int(a.shape[0])
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise BadRequest(f"adapter {name!r}: shapes at {module!r} do not fit the model")
        mod_alpha = _pattern(config.get("alpha_pattern"), module, alpha)
        scale = mod_alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        a, b = a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)
        nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
        deltas[module] = LoraDelta(a=a, b=b, scale=scale)
    return LoraAdapter(
        name=name,
        deltas=deltas,
        nbytes=nbytes,
        fingerprint=fingerprint(directory, [CONFIG_FILE, WEIGHTS_FILE]),
    )
