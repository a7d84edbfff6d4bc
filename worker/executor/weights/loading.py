"""Model loading: local directory or hub id, dtype policy, GGUF, offline mode.

A GGUF checkpoint is named either as a directory (or hub id) plus ``gguf_file``, or as the path of
the ``.gguf`` file itself (``split_gguf_path`` turns the latter into the former).

Offline mode is huggingface_hub's (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``; the hub library
reads them at import, ``offline()`` also re-reads them at load time); when it is on, loading never
touches the network (``local_files_only=True``). Before anything loads,
``source.check_model_source`` refuses a missing local path or an unreachable hub id at once.
``trust_remote_code`` stays off unless the caller asks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from worker.errors import ConfigError
from worker.executor.vision.arch import served_class
from worker.executor.weights.gguf_cache import shared_gguf_parses
from worker.executor.weights.source import check_model_source, offline

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


def cpu_bf16_support() -> bool | None:
    """Whether this CPU multiplies bfloat16 natively (``amx_bf16`` or ``avx512_bf16`` among the
    ``/proc/cpuinfo`` flags); ``None`` where the flags cannot be read (not Linux)."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line for line in fh if line.startswith("flags")), "").split()
    except OSError:
        return None
    return bool({"amx_bf16", "avx512_bf16"} & set(flags))


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Model dtype: explicit names as given; ``auto`` = bfloat16 on CUDA (float16 without bf16
    support), float32 on CPU (half-precision matmuls are slow and inexact there). bfloat16 on a
    CPU without native support (no AMX, no AVX512-BF16) is allowed but warned about: its matmuls
    are emulated there, several times slower than float32."""
    if dtype not in ("auto", *_DTYPES):
        raise ConfigError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {dtype!r}")
    if dtype != "auto":
        if device.type == "cpu" and dtype != "float32" and cpu_bf16_support() is False:
            log.warning(
                "dtype %s on a CPU without native bfloat16 (no amx_bf16 / avx512_bf16 flag): "
                "its matmuls are emulated and slower than float32 here",
                dtype,
            )
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


@contextlib.contextmanager
def timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Add the seconds the block takes to ``phases[name]`` (the cold-start phases,
    ``worker.observability.startup``)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - started


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


#: ``--reward-head`` value -> the transformers auto class a reward checkpoint loads as.
REWARD_HEAD_CLASSES = {
    "sequence": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "lm-label": "AutoModelForCausalLM",
}


def reward_head_of(architectures: Any) -> str:
    """The reward head a checkpoint's ``config.architectures`` implies: ``token-classification``
    (``*ForTokenClassification``), ``lm-label`` (``*ForCausalLM`` / ``*LMHeadModel``), else
    ``sequence`` (also when the config names none, as a GGUF file's does)."""
    for arch in architectures or ():
        if str(arch).endswith("ForTokenClassification"):
            return "token-classification"
        if str(arch).endswith(("ForCausalLM", "LMHeadModel")):
            return "lm-label"
    return "sequence"


def load_model(
    name_or_path: str,
    *,
    kind: Literal["causal", "reward"],
    device: torch.device,
    dtype: torch.dtype,
    gguf_file: str | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    reward_head: str = "auto",
    distributed_config: Any = None,
    timings: dict[str, float] | None = None,
) -> nn.Module:
    """Load a ``*ForCausalLM`` (``kind="causal"``) or a reward model (``"reward"``): the class
    ``reward_head`` names (``REWARD_HEAD_CLASSES``; ``auto``: the checkpoint's architecture).

    ``name_or_path`` may be a ``.gguf`` file (see ``split_gguf_path``). Loaded in eval mode on
    ``device`` with ``dtype``; any loading failure becomes ``ConfigError``, and so do weights the
    checkpoint lacks (transformers would initialise them at random): they are named.
    ``distributed_config`` (a transformers ``DistributedConfig``, inside an initialised
    ``torch.distributed`` group): each rank loads only its shard (``worker.executor.parallel``).
    ``timings``: seconds of ``model_read`` and ``placement`` are added to it (the cold-start
    phases, ``worker.observability.startup``).
    """
    import transformers

    # A missing local path fails here at once; serve also checks hub ids (offline, reachable).
    check_model_source(name_or_path, flag=f"{kind} model", gguf_file=gguf_file, hub=False)
    name_or_path, gguf_file = split_gguf_path(name_or_path, gguf_file)

    cls: Any = transformers.AutoModelForCausalLM
    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "trust_remote_code": trust_remote_code,
        "local_files_only": offline() or os.path.isdir(name_or_path),
    }
    if revision is not None:
        kwargs["revision"] = revision
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    if distributed_config is not None:
        kwargs["distributed_config"] = distributed_config
    elif device.type == "cuda":
        # Straight to the device: each safetensors tensor is copied to the GPU as it is read,
        # instead of the whole model built in host memory first and copied over after.
        kwargs["device_map"] = str(device)
    log.info("loading %s model %s (gguf=%s, dtype=%s)", kind, name_or_path, gguf_file, dtype)
    phases = {} if timings is None else timings
    parses = shared_gguf_parses() if gguf_file is not None else contextlib.nullcontext()
    with timed(phases, "model_read"), parses:
        try:
            if kind == "reward":
                if reward_head == "auto":
                    config = transformers.AutoConfig.from_pretrained(name_or_path, **kwargs)
                    reward_head = reward_head_of(getattr(config, "architectures", None))
                if reward_head not in REWARD_HEAD_CLASSES:
                    raise ConfigError(f"unknown reward head {reward_head!r}")
                cls = getattr(transformers, REWARD_HEAD_CLASSES[reward_head])
            elif gguf_file is None:  # an image-text model: its served class, or refused
                keep = ("trust_remote_code", "local_files_only", "revision")
                config = transformers.AutoConfig.from_pretrained(
                    name_or_path, **{k: v for k, v in kwargs.items() if k in keep}
                )
                served = served_class(config)
                cls = getattr(transformers, served) if served is not None else cls
            model, info = cls.from_pretrained(name_or_path, output_loading_info=True, **kwargs)
        except (OSError, ValueError, KeyError, ImportError) as exc:
            raise ConfigError(f"cannot load {kind} model {name_or_path!r}: {exc}") from exc
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ConfigError(missing_weights_message(name_or_path, kind, reward_head, missing))
    with timed(phases, "placement"):
        model.to(device)
        model.eval()
    return model


def missing_weights_message(name: str, kind: str, head: str, missing: list[str]) -> str:
    """Why a checkpoint that lacks weights is refused, naming them and the likely cause."""
    shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
    why = f"{kind} model {name!r} lacks weights {shown}: they would be initialised at random"
    if kind == "causal":
        return why + "; is it a reward checkpoint? serve it with --reward-model"
    if head == "sequence":
        return why + (
            "; a causal-LM checkpoint is served as a reward model only as an LM-label process "
            "reward model (--reward-head lm-label, jobs with step.label_token_ids)"
        )
    return why


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
    reward_head: str = "auto",
    distributed_config: Any = None,
    timings: dict[str, float] | None = None,
) -> tuple[nn.Module | None, nn.Module | None]:
    """``(reference, reward)``: each named model loaded with ``load_model`` (``None`` when not
    named); at least one must be named (``ConfigError``). ``timings``: see ``load_model``."""
    if not reference_model and not reward_model:
        raise ConfigError("from_pretrained needs reference_model and/or reward_model")
    common: dict[str, Any] = {
        "device": device,
        "dtype": dtype,
        "trust_remote_code": trust_remote_code,
        "revision": revision,
        "distributed_config": distributed_config,
        "timings": timings,
    }
    ref = rew = None
    if reference_model:
        ref = load_model(reference_model, kind="causal", gguf_file=gguf_file, **common)
    if reward_model:
        rew = load_model(
            reward_model,
            kind="reward",
            gguf_file=reward_gguf_file,
            reward_head=reward_head,
            **common,
        )
    return ref, rew


def load_tokenizer(name_or_path: str, *, gguf_file: str | None = None) -> Any:
    """The tokenizer stored with a model (GGUF files carry theirs); for demos and tests."""
    from transformers import AutoTokenizer

    name_or_path, gguf_file = split_gguf_path(name_or_path, gguf_file)

    kwargs: dict[str, Any] = {"local_files_only": offline() or os.path.isdir(name_or_path)}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    return AutoTokenizer.from_pretrained(name_or_path, **kwargs)


#: Files one of which a checkpoint folder with a tokenizer holds.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.txt",
)


def has_tokenizer_files(name_or_path: str) -> bool:
    """Whether a local checkpoint folder holds tokenizer files (a hub id or a GGUF file: True,
    they are looked for when loading); a folder without them would make transformers guess a
    slow tokenizer class and warn at length before failing."""
    path = Path(name_or_path)
    if not path.is_dir():
        return True
    return any((path / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizers(
    reference_model: str | None,
    reward_model: str | None,
    gguf_file: str | None = None,
    reward_gguf_file: str | None = None,
) -> tuple[Any, Any]:
    """``(reference tokenizer, reward tokenizer)`` stored with the checkpoints, each ``None``
    when not named, or when the checkpoint carries none (logged): the reward model's renders
    ``messages`` (the two are compared), the reference model's tokenizes student text."""

    def one(name: str | None, gguf: str | None) -> Any:
        if not name:
            return None
        if gguf is None and not has_tokenizer_files(name):
            log.info("%s has no tokenizer files: token ids only (no messages, no text)", name)
            return None
        try:
            return load_tokenizer(name, gguf_file=gguf)
        except Exception as exc:  # no tokenizer files: token ids only
            log.warning("no tokenizer with %s (%s): messages cannot be rendered", name, exc)
            return None

    return one(reference_model, gguf_file), one(reward_model, reward_gguf_file)
