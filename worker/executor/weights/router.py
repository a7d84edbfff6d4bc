"""Per-job weights of a ``StatelessExecutor``: route a call to its version and adapter.

``WeightsRouter`` owns the ``Residency`` of one executor: LoRA adapters (applied to the shared
base, or to a version, through ``adapters.LoraHooks``) and versions (a full checkpoint under
``model_root``, loaded with ``trust_remote_code`` off and served by its own executor built by
the ``build`` callable the parent passes in). A version replaces the served reference model (or,
on a reward-only executor, the reward model); a separately loaded reward model is not
versioned. ``score`` picks the weights a call names, runs the call with them and attaches a
``WeightsReport`` (provenance, hit or miss, loads, what is resident) to its metrics.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker.errors import ConfigError, ModelNotFound, ScoringError
from worker.executor.weights import adapters
from worker.executor.weights.loading import load_model
from worker.executor.weights.residency import Residency, Resident, WeightsConfig, split_preload
from worker.request import ScoreOptions
from worker.scorer.outputs import ScoreOutput
from worker.scorer.weights import WeightsReport

#: Builds a version's executor from its loaded model: ``build(model)``.
Build = Callable[[nn.Module], Any]


def refuse(options: ScoreOptions) -> None:
    """``ModelNotFound`` when ``options`` name weights on an executor that serves none."""
    for kind, name in (("adapter", options.adapter), ("version", options.version)):
        if name is not None:
            root = "adapter" if kind == "adapter" else "model"
            raise ModelNotFound(f"this worker serves no {kind}s (no --{root}-root)")


def _model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _version_fingerprint(path: Path) -> str:
    files = [f.name for f in sorted(path.iterdir()) if f.suffix in (".json", ".safetensors")]
    return adapters.fingerprint(path, [f for f in files if f != "tokenizer.json"], full=False)


class WeightsRouter:
    """Adapters and versions of one executor (see the module docstring)."""

    def __init__(
        self,
        config: WeightsConfig,
        models: tuple[nn.Module, ...],
        *,
        kind: str,
        device: torch.device,
        build: Build,
    ) -> None:
        self.config = config
        self._device = device
        self._dtype = next(models[0].parameters()).dtype
        self._kind = kind  # "causal" or "reward": what a version loads as
        self._build = build
        self._hooks = adapters.LoraHooks(list(models))
        self.residency = Residency(
            config, {"adapter": self._load_adapter, "version": self._load_version}
        )
        for item in config.preload:
            kind_, name = split_preload(item)
            try:
                self.residency.acquire(kind_, name, reason="preload")
            except ScoringError as exc:
                raise ConfigError(f"--preload {item!r}: {exc.message}") from exc

    def _load_adapter(self, name: str, path: Path) -> Resident:
        lora = adapters.load_lora(
            name, path, self._hooks.shapes, device=self._device, dtype=self._dtype
        )
        return Resident("adapter", name, lora, lora.nbytes, lora.fingerprint)

    def _load_version(self, name: str, path: Path) -> Resident:
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"version {name!r} has no config.json")
        model = load_model(
            str(path),
            kind="causal" if self._kind == "causal" else "reward",
            device=self._device,
            dtype=self._dtype,
            trust_remote_code=False,  # a job never enables remote code
        )
        executor = self._build(model)
        hooks = adapters.LoraHooks([model])
        executor.lora_hooks = hooks  # lives as long as the version's executor
        return Resident("version", name, executor, _model_bytes(model), _version_fingerprint(path))

    def check(self, options: ScoreOptions) -> None:
        """Refuse names that are unsafe or match no directory (cheap: no load)."""
        if options.adapter is not None:
            self.residency.check("adapter", options.adapter)
        if options.version is not None:
            self.residency.check("version", options.version)

    def score(
        self, options: ScoreOptions, parent: Any, run: Callable[[Any], ScoreOutput]
    ) -> ScoreOutput:
        """``run(executor)`` under the call's weights; the output carries a ``WeightsReport``."""
        hits: list[bool] = []
        target, lora, prints = parent, None, []
        if options.version is not None:
            item, hit = self.residency.acquire("version", options.version)
            target = item.value
            hits.append(hit)
            prints.append(item.fingerprint)
        if options.adapter is not None:
            item, hit = self.residency.acquire("adapter", options.adapter)
            lora = item.value
            hits.append(hit)
            prints.append(item.fingerprint)
        with adapters.active(lora):
            out = run(target)
        loads, evictions = self.residency.drain_events()
        out.metrics.weights = WeightsReport(
            adapter=options.adapter,
            version=options.version,
            fingerprint=_combine(prints),
            hit=all(hits) if hits else None,
            holdings=self.residency.holdings(),
            loads=loads,
            evictions=evictions,
        )
        return out


def _combine(prints: list[str]) -> str | None:
    if not prints:
        return None
    if len(prints) == 1:
        return prints[0]
    return hashlib.sha256("+".join(prints).encode()).hexdigest()[:16]
