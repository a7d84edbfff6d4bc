"""The tensor-parallel plan: how one model is cut over the N ranks of a group, and what refuses.

``tensor_parallel_plan(config, size)`` is the whole plan, one function of the checkpoint's
config and the group size (as torchtitan's ``parallelize_llama`` is of the model and the mesh).
transformers already holds the per-architecture rules (``config.base_model_tp_plan``,
``DistributedConfig(tp_size=N)``): the plan takes them as they are and says what the executor
adds and relies on. Everything a plan cannot serve is refused here, at start, with the numbers
and the sizes that would work (``ConfigError``, one line of ``error: ...``).

Torch-free apart from building the ``DistributedConfig`` at the end (transformers is imported
there, on use), so the commands layer can check a checkpoint's config before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.errors import ConfigError

__all__ = ["MAX_GROUP", "Plan", "device_check", "tensor_parallel_plan", "working_sizes"]

MAX_GROUP = 8
"""The largest group the messages list sizes for: the GPUs of one node."""


@dataclass(frozen=True)
class Plan:
    """What ``tensor_parallel_plan`` settled for one model: the group size, the numbers every
    rank takes a whole share of, and the ``DistributedConfig`` its ranks load it with."""

    size: int
    model: str
    heads: int
    kv_heads: int
    vocab: int

    def distributed_config(self) -> Any:
        """``DistributedConfig(tp_size=size)``: transformers' own plan for the architecture."""
        from transformers.distributed import DistributedConfig

        return DistributedConfig(tp_size=self.size)

    @property
    def shard_vocab(self) -> int:
        """Vocabulary ids each rank's LM-head (and embedding) shard holds."""
        return self.vocab // self.size


def working_sizes(heads: int, kv_heads: int, vocab: int, limit: int = MAX_GROUP) -> list[int]:
    """Group sizes up to ``limit`` that divide the attention heads, the KV heads and the
    vocabulary (every rank takes a whole share of each)."""
    return [n for n in range(1, limit + 1) if not (heads % n or kv_heads % n or vocab % n)]


def tensor_parallel_plan(config: Any, size: int, *, name: str = "the model") -> Plan:
    """The plan of ``config`` (a transformers ``PretrainedConfig``) over ``size`` ranks.

    * **Backbone**: transformers' rules for the architecture as they stand
      (``base_model_tp_plan``): q/k/v projections column-wise (each rank holds whole attention
      heads and whole KV heads), ``o_proj`` row-wise (an all-reduce), the MLP's gate/up
      column-wise and down row-wise (an all-reduce), the input embedding split on the
      vocabulary (each rank looks up its ids, an all-reduce sums them). Norms, rotary tables and
      every reward head's ``score`` layer stay whole on every rank (replicated): a reward is
      pooled at the true last token of the replicated hidden states, with no collective.
    * **LM head**: its weight split on the vocabulary (``Shard(0)``, rank ``r`` holds ids
      ``r * V / N .. (r + 1) * V / N - 1``). Its own forward, which would all-gather the
      ``[N, V]`` logits on every rank, is never called while scoring: each rank folds its own
      shard (``worker.executor.parallel.head``) and the ranks combine per-row statistics. The
      load-time probe compares the fold with that gathered forward on three short sequences.

    Refused (``ConfigError`` naming the numbers): a vision-language model (a config with a
    ``vision_config``: images are not served by a group), an architecture whose config has no
    ``base_model_tp_plan``, and a ``size`` that does not divide the attention heads, the KV
    heads and the vocabulary (the message lists the sizes that do).
    """
    if not isinstance(size, int) or size < 1:
        raise ConfigError(f"--tensor-parallel must be an integer >= 1, got {size!r}")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    arch = ", ".join(getattr(config, "architectures", None) or [type(config).__name__])
    if getattr(config, "vision_config", None) is not None:
        raise ConfigError(
            f"--tensor-parallel {size}: {name} ({arch}) is a vision-language model; images "
            "are not served under tensor parallelism (the group's load check, the vision "
            "tower's placement beside the sharded language model and the image features of a "
            "broadcast batch are not checked against one process)",
            hint="serve it without --tensor-parallel (one process per device)",
        )
    if not getattr(text, "base_model_tp_plan", None):
        raise ConfigError(
            f"--tensor-parallel {size}: {name} ({arch}, model_type "
            f"{getattr(text, 'model_type', '?')!r}) has no tensor-parallel plan in transformers "
            "(its config's base_model_tp_plan is empty)",
            hint="serve it without --tensor-parallel (one process per device), or use an "
            "architecture that has one (Llama, Qwen2, Mistral, Gemma, ...)",
        )
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    if min(heads, kv_heads, vocab) < 1:
        raise ConfigError(f"--tensor-parallel {size}: {name} ({arch}) names no head counts")
    plan = Plan(size=size, model=name, heads=heads, kv_heads=kv_heads, vocab=vocab)
    if heads % size or kv_heads % size or vocab % size:
        sizes = ", ".join(map(str, working_sizes(heads, kv_heads, vocab)))
        raise ConfigError(
            f"--tensor-parallel {size}: {name} ({arch}) has {heads} attention heads, "
            f"{kv_heads} KV heads and a vocabulary of {vocab}; each rank needs a whole share "
            f"of every one of them. Sizes that work: {sizes}",
        )
    return plan


def device_check(size: int, device: str, visible_gpus: int, cpu_cores: int) -> None:
    """``ConfigError`` when a group of ``size`` ranks cannot have a device each: more ranks than
    visible GPUs on CUDA, more than the CPU's cores on CPU, or a ``device`` naming one GPU
    (``cuda:N``; a group takes ``cuda:0 .. cuda:size-1`` of what ``CUDA_VISIBLE_DEVICES``
    shows)."""
    if device.startswith("cuda:"):
        raise ConfigError(
            f"--device {device} names one GPU, but --tensor-parallel {size} takes one GPU per rank",
            hint="use --device cuda: rank r runs on cuda:r of CUDA_VISIBLE_DEVICES "
            "(--gpus all --tensor-parallel N hands each group its own GPUs)",
        )
    if device in ("cuda", "auto") and visible_gpus:
        if size > visible_gpus:
            raise ConfigError(
                f"--tensor-parallel {size} needs {size} GPUs (one per rank); this process sees "
                f"{visible_gpus}",
                hint="check CUDA_VISIBLE_DEVICES, or lower --tensor-parallel",
            )
        return
    if device == "cuda":
        raise ConfigError(f"--tensor-parallel {size} --device cuda: no CUDA device is visible")
    if size > cpu_cores:
        raise ConfigError(
            f"--tensor-parallel {size} on the CPU needs a core per rank; this machine has "
            f"{cpu_cores}",
        )
