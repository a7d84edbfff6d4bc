"""Model loading: local directory or hub id, dtype policy, GGUF, offline mode.

A GGUF checkpoint is named either as a directory (or hub id) plus ``gguf_file``, or as the path of
the ``.gguf`` file itself (``split_gguf_path`` turns the latter into the former).

Offline mode is huggingface_hub's (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``; the hub library
reads them at import, ``offline()`` also re-reads them at load time); when it is on, loading never
touches the network (``local_files_only=True``).
``trust_remote_code`` stays off unless the caller asks.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from worker.errors import ConfigError

log = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> CUDA if available, else CPU; other strings as torch reads them."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"invalid device {device!r}: {exc}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Model dtype: explicit names as given; ``auto`` = bfloat16 on CUDA (float16 without bf16
    support), float32 on CPU (half-precision matmuls are slow and inexact there)."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


_TRUE = {"1", "ON", "YES", "TRUE"}


def offline() -> bool:
    """Whether loading must stay offline: huggingface_hub's offline mode, or ``HF_HUB_OFFLINE`` /
    ``TRANSFORMERS_OFFLINE`` set now (huggingface_hub reads them once, at import)."""
    from huggingface_hub import is_offline_mode

    if is_offline_mode():
        return True
    return any(
        os.environ.get(name, "").upper() in _TRUE
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def split_gguf_path(name_or_path: str, gguf_file: str | None = None) -> tuple[str, str | None]:
    """``(directory or hub id, gguf file name or None)``: the path of a ``.gguf`` file becomes
    its directory and file name (``ConfigError`` when no such file exists); anything else is
    returned as given.

    ``gguf_file`` given with a ``.gguf`` path must name that same file (``ConfigError`` if not).
    """
    path = Path(name_or_path)
    if path.suffix.lower() != ".gguf":
        return name_or_path, gguf_file
    if not path.exists():
        raise ConfigError(f"no such GGUF file: {name_or_path}")
    if not path.is_file():  # a directory that happens to end in .gguf
        return name_or_path, gguf_file
    if gguf_file is not None and gguf_file not in (path.name, str(path)):
        raise ConfigError(f"model path {name_or_path!r} is a GGUF file but gguf_file={gguf_file!r}")
    return str(path.parent), path.name


def load_model(
    name_or_path: str,
    *,
    kind: Literal["causal", "reward"],
    device: torch.device,
    dtype: torch.dtype,
    gguf_file: str | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
) -> nn.Module:
    """Load a ``*ForCausalLM`` (``kind="causal"``) or ``*ForSequenceClassification`` (``"reward"``).

    ``name_or_path`` may be a ``.gguf`` file (see ``split_gguf_path``). Loaded in eval mode on
    ``device`` with ``dtype``; any loading failure becomes ``ConfigError``.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    name_or_path, gguf_file = split_gguf_path(name_or_path, gguf_file)

    cls: Any = AutoModelForCausalLM if kind == "causal" else AutoModelForSequenceClassification
    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "trust_remote_code": trust_remote_code,
        "local_files_only": offline() or os.path.isdir(name_or_path),
    }
    if revision is not None:
        kwargs["revision"] = revision
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    log.info("loading %s model %s (gguf=%s, dtype=%s)", kind, name_or_path, gguf_file, dtype)
    try:
        model = cls.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise ConfigError(f"cannot load {kind} model {name_or_path!r}: {exc}") from exc
    model.to(device)
    model.eval()
    return model


def load_models(
    reference_model: str | None,
    reward_model: str | None,
    *,
    device: torch.device,
    dtype: torch.dtype,
    gguf_file: str | None = None,
    reward_gguf_file: str | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
) -> tuple[nn.Module | None, nn.Module | None]:
    """``(reference, reward)``: each named model loaded with ``load_model`` (``None`` when not
    named); at least one must be named (``ConfigError``)."""
    if not reference_model and not reward_model:
        raise ConfigError("from_pretrained needs reference_model and/or reward_model")
    common: dict[str, Any] = {
        "device": device,
        "dtype": dtype,
        "trust_remote_code": trust_remote_code,
        "revision": revision,
    }
    ref = rew = None
    if reference_model:
        ref = load_model(reference_model, kind="causal", gguf_file=gguf_file, **common)
    if reward_model:
        rew = load_model(reward_model, kind="reward", gguf_file=reward_gguf_file, **common)
    return ref, rew


def load_tokenizer(name_or_path: str, *, gguf_file: str | None = None) -> Any:
    """The tokenizer stored with a model (GGUF files carry theirs); for demos and tests."""
    from transformers import AutoTokenizer

    name_or_path, gguf_file = split_gguf_path(name_or_path, gguf_file)

    kwargs: dict[str, Any] = {"local_files_only": offline() or os.path.isdir(name_or_path)}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    return AutoTokenizer.from_pretrained(name_or_path, **kwargs)
