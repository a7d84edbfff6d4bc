"""What a scorer reports about per-job weights (adapters, versions): torch-free plain data.

The executor's residency manager (``worker.executor.weights.residency``) produces these; the daemon
turns them into result ``info`` (provenance) and metrics (``worker.daemon.weights``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

WeightsKind = Literal["adapter", "version"]
#: Why a load happened: first use, reload of something evicted before, or ``--preload``.
LOAD_REASONS: tuple[str, ...] = ("miss", "evict", "preload")
#: How a load ended.
LOAD_OUTCOMES: tuple[str, ...] = ("ok", "not_found", "error")


@dataclass(frozen=True)
class LoadEvent:
    """One load of an adapter or version: what, why, how it ended, how long it took."""

    kind: WeightsKind
    name: str
    reason: str  # one of LOAD_REASONS
    outcome: str  # one of LOAD_OUTCOMES
    seconds: float
    bytes: int = 0


@dataclass(frozen=True)
class Holdings:
    """What a scorer holds now: resident adapters and versions (LRU order, oldest first)."""

    adapters: tuple[str, ...] = ()
    versions: tuple[str, ...] = ()
    bytes: int = 0


@dataclass(frozen=True)
class WeightsReport:
    """The weights one scorer call ran with, and the residency events since the last report.

    ``hit``: the adapter/version was resident when the call asked for it (``None`` when the call
    named neither). ``fingerprint``: a content hash of the weights that ran (adapter files in
    full; a version's configs and safetensors headers, sizes and edges, see
    ``worker.executor.weights.adapters.fingerprint``).
    """

    adapter: str | None
    version: str | None
    fingerprint: str | None
    hit: bool | None
    holdings: Holdings
    loads: tuple[LoadEvent, ...] = field(default_factory=tuple)
    evictions: int = 0

    def provenance(self) -> dict[str, str]:
        """Result ``info`` keys: ``adapter``, ``version``, ``weights_fingerprint`` (set ones)."""
        out = {"adapter": self.adapter, "version": self.version}
        out["weights_fingerprint"] = self.fingerprint
        return {k: v for k, v in out.items() if v is not None}
