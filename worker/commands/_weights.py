"""The ``serve`` flags of per-job weights (``docs/models.md``): where adapters and versions live,
the residency budget and what to preload; each with its ``SCORING_*`` variable."""

from __future__ import annotations

import argparse
from typing import Any

from worker.config import env_get


def _int_env(name: str, default: int) -> int:
    raw = env_get(name)
    return int(raw) if raw not in (None, "") else default


def add_weights_args(parser: argparse.ArgumentParser) -> None:
    """Add the per-job weights flags (a group of their own)."""
    w = parser.add_argument_group("per-job weights (adapter / version job keys)")
    w.add_argument(
        "--adapter-root",
        default=env_get("ADAPTER_ROOT"),
        help="directory of PEFT LoRA adapters; a job's 'adapter' names one under it",
    )
    w.add_argument(
        "--model-root",
        default=env_get("MODEL_ROOT"),
        help="directory of full checkpoints (step-N/); a job's 'version' names one under it",
    )
    w.add_argument(
        "--max-resident-adapters",
        type=int,
        default=_int_env("MAX_RESIDENT_ADAPTERS", 8),
        help="adapters kept loaded (least recently used evicted first)",
    )
    w.add_argument(
        "--max-resident-versions",
        type=int,
        default=_int_env("MAX_RESIDENT_VERSIONS", 1),
        help="full-checkpoint versions kept loaded besides the base",
    )
    w.add_argument(
        "--max-resident-bytes",
        type=int,
        default=_int_env("MAX_RESIDENT_BYTES", 0),
        help="byte budget of resident adapters + versions (0: count limits only)",
    )
    w.add_argument(
        "--preload",
        default=env_get("PRELOAD", ""),
        help="comma-separated names to load at start: adapter:NAME, version:NAME (bare: adapter)",
    )


def weights_config(args: argparse.Namespace) -> Any:
    """The executor's ``WeightsConfig`` from the flags (``None`` when no root is set)."""
    if not (args.adapter_root or args.model_root):
        return None
    from worker.executor.weights.residency import WeightsConfig

    return WeightsConfig(
        adapter_root=args.adapter_root,
        model_root=args.model_root,
        max_resident_adapters=args.max_resident_adapters,
        max_resident_versions=args.max_resident_versions,
        max_resident_bytes=args.max_resident_bytes,
        preload=tuple(p.strip() for p in (args.preload or "").split(",") if p.strip()),
    )
