"""Attention backends: the fallback chain, load-time resolution, run-time kernel-error detection.

Chain: ``flash_attention_2 -> sdpa -> eager``. At load, a backend that cannot be used (flash-attn
not installed, a CPU device, a float32 model) is skipped with a recorded reason. At run time only
an error raised inside an attention kernel (``is_attention_kernel_error``) moves a batch to the next
backend. Switching goes through transformers 5's ``model.set_attn_implementation``; if a switch
raises, every config it may have touched is restored (``switch_backend``).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch
from torch import nn

from worker.errors import ConfigError
from worker.executor import flex
from worker.executor.config import Layout
from worker.scorer.outputs import FallbackEvent

CHAIN: tuple[str, ...] = ("flash_attention_2", "sdpa", "eager")
# Backends whose transformers 5 integration isolates sequences packed in one row from
# restarting position_ids (masking_utils.find_packed_sequence_indices / flash varlen).
PACKABLE: frozenset[str] = frozenset(
    {"flash_attention_2", "flash_attention_3", "sdpa", "eager", "flex_attention"}
)
# Backends whose kernel skips the cross-sequence blocks of a packed row (flash varlen from
# cu_seqlens, flex block masks): packing costs them nothing. sdpa and eager materialise a dense
# [T, T] mask and compute every block of it.
VARLEN: frozenset[str] = frozenset({"flash_attention_2", "flash_attention_3", "flex_attention"})
_KERNEL_FILES = (
    os.path.join("integrations", "sdpa_attention.py"),
    os.path.join("integrations", "flash_attention.py"),
    os.path.join("integrations", "flex_attention.py"),
    os.path.join("integrations", "flash_paged.py"),
    "modeling_flash_attention_utils.py",
    os.path.join("flash_attn", ""),
)


def chain_for(requested: str, device: torch.device, dtype: torch.dtype) -> list[str]:
    """Backends to try, in order, for ``requested`` (``auto`` tries flash only where it can run)."""
    if requested == "auto":
        flash_ok = precheck("flash_attention_2", device, dtype) is None
        return (["flash_attention_2"] if flash_ok else []) + ["sdpa", "eager"]
    if requested in CHAIN:
        return list(CHAIN[CHAIN.index(requested) :])
    return [requested, "sdpa", "eager"]


def precheck(backend: str, device: torch.device, dtype: torch.dtype) -> tuple[str, str] | None:
    """``(reason, message)`` when ``backend`` certainly cannot run here, else ``None``."""
    if not backend.startswith("flash_attention"):
        return None
    if importlib.util.find_spec("flash_attn") is None:
        return "not_installed", "flash_attn is not installed"
    if device.type != "cuda":
        return "unsupported_device", f"{backend} needs a CUDA device, model is on {device}"
    if dtype not in (torch.float16, torch.bfloat16):
        return "unsupported_dtype", f"{backend} needs float16/bfloat16, model dtype is {dtype}"
    return None


def active_backend(model: nn.Module) -> str:
    """The attention implementation the model's config currently names."""
    config: Any = getattr(model, "config", None)
    return str(getattr(config, "_attn_implementation", None) or "eager")


def _configs(model: nn.Module) -> list[Any]:
    """Every config object ``set_attn_implementation`` may write to (modules' and sub-configs)."""
    seen: dict[int, Any] = {}
    stack = [getattr(m, "config", None) for m in model.modules()]
    while stack:
        cfg = stack.pop()
        if cfg is None or id(cfg) in seen or not hasattr(cfg, "_attn_implementation_internal"):
            continue
        seen[id(cfg)] = cfg
        for key in getattr(cfg, "sub_configs", {}) or {}:
            stack.append(getattr(cfg, key, None))
    return list(seen.values())


def switch_backend(model: nn.Module, backend: str) -> None:
    """Set ``backend`` on ``model``; on any failure restore every config exactly and re-raise."""
    if backend == "flex_attention":
        flex.install()  # CPU calls run the eager math (worker.executor.flex)
    snapshot = [(cfg, cfg._attn_implementation_internal) for cfg in _configs(model)]
    try:
        setter = getattr(model, "set_attn_implementation", None)
        if setter is None:
            raise ValueError(f"{type(model).__name__} cannot switch attention implementation")
        setter(backend)
        if active_backend(model) != backend:
            raise ValueError(f"{type(model).__name__} did not accept attn_implementation={backend}")
    except Exception:
        for cfg, value in snapshot:
            cfg._attn_implementation_internal = value
        raise


@contextmanager
def temporary_backend(model: nn.Module, backend: str) -> Iterator[None]:
    """Run a block on ``backend``, then put the previous backend back (configs restored exactly)."""
    snapshot = [(cfg, cfg._attn_implementation_internal) for cfg in _configs(model)]
    try:
        switch_backend(model, backend)
        yield
    finally:
        for cfg, value in snapshot:
            cfg._attn_implementation_internal = value


def classify_load_error(backend: str, exc: BaseException) -> str:
    """Short reason class for a backend that failed to be set at load."""
    text = str(exc).lower()
    if isinstance(exc, ImportError) or "not installed" in text or "package" in text:
        return "not_installed"
    if "dtype" in text:
        return "unsupported_dtype"
    if "gpu" in text or "cuda" in text or "device" in text:
        return "unsupported_device"
    return "unsupported_model"


def resolve(
    model: nn.Module, requested: str, device: torch.device, dtype: torch.dtype
) -> tuple[str, FallbackEvent | None]:
    """Set the first usable backend of ``requested``'s chain on ``model``.

    Returns the backend now active and the ``FallbackEvent`` (``at="load"``) when it is not the
    one requested (``None`` for ``auto`` unless even sdpa failed). Raises ``RuntimeError`` when
    nothing in the chain can be set.
    """
    failures: list[tuple[str, str, str]] = []  # (backend, reason, message)
    for backend in chain_for(requested, device, dtype):
        pre = precheck(backend, device, dtype)
        if pre is not None:
            failures.append((backend, *pre))
            continue
        try:
            switch_backend(model, backend)
        except Exception as exc:  # transformers raises ValueError/ImportError/KeyError here
            failures.append((backend, classify_load_error(backend, exc), str(exc)[:300]))
            continue
        event = None
        first = "sdpa" if requested == "auto" else requested
        if failures and (requested != "auto" or backend != first):
            event = FallbackEvent(
                requested=requested,
                used=backend,
                reason=failures[0][1],
                message="; ".join(f"{b}: {m}" for b, _, m in failures),
                at="load",
            )
        return backend, event
    raise RuntimeError(
        "no attention backend could be set: " + "; ".join(f"{b}: {m}" for b, _, m in failures)
    )


def resolve_all(
    models: Sequence[nn.Module], requested: str, device: torch.device
) -> tuple[str, list[FallbackEvent]]:
    """``resolve`` on every served model (each in its own dtype): the backend active at the end
    and the load-time fallbacks taken. ``ConfigError`` when a model can be set to none."""
    active, events = "", []
    for model in models:
        dtype = next(model.parameters()).dtype
        try:
            active, event = resolve(model, requested, device, dtype)
        except RuntimeError as exc:
            raise ConfigError(str(exc)) from exc
        if event is not None:
            events.append(event)
    return active, events


def _kernel_codes() -> set[Any]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return {getattr(fn, "__code__", None) for fn in ALL_ATTENTION_FUNCTIONS.values()} - {None}


def is_attention_kernel_error(exc: BaseException) -> bool:
    """True when ``exc`` was raised inside an attention kernel (not elsewhere in the model).

    Looks at the traceback: a frame of a registered transformers attention function, of a
    model's ``eager_attention_forward``, or of the sdpa/flash/flex integration modules.
    Out-of-memory errors are never kernel errors (they are handled by splitting the batch). An
    exception with a true ``attention_kernel_error`` attribute counts as one: what the other
    ranks of a tensor-parallel group raise when one rank's kernel failed
    (``worker.executor.parallel.forward``).
    """
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    if getattr(exc, "attention_kernel_error", False):  # a tensor-parallel rank's stand-in
        return True
    codes = _kernel_codes()
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code in codes or code.co_name == "eager_attention_forward":
            return True
        if any(part in code.co_filename for part in _KERNEL_FILES):
            return True
        tb = tb.tb_next
    return False


def next_backend(current: str) -> str | None:
    """The backend after ``current`` in the chain (``None`` after eager)."""
    if current in CHAIN:
        i = CHAIN.index(current)
        return CHAIN[i + 1] if i + 1 < len(CHAIN) else None
    return "sdpa"


def layout_for(backend: str, *, packed: bool, unmasked: bool) -> Layout:
    """The batch layout on ``backend`` given the layouts still allowed (``packed``,
    ``unmasked``): packed rows where the kernel skips cross-sequence blocks, else unmasked
    buckets, else packed rows with a dense mask, else masked padded buckets."""
    packable = packed and backend in PACKABLE
    if packable and backend in VARLEN:
        return "packed"
    if unmasked:
        return "unmasked"
    return "packed" if packable else "padded"
