"""Residency of per-job weights: safe names, on-demand loads, one load per name, LRU under a budget.

``WeightsConfig`` says where adapters (``adapter_root``) and full-checkpoint versions
(``model_root``) live and how many may stay resident. ``resolve_under`` turns a job's name into
a directory under a root, refusing absolute paths, ``..``, and symlinks that leave the root
(``BadRequest``), and names that match no directory (``ModelNotFound``): nothing outside the
configured roots is ever opened.

``Residency`` keeps loaded items in least-recently-used order. ``acquire`` returns a resident
item or loads it in the calling thread (the daemon's scoring thread, never the lease keeper);
concurrent callers for the same name wait on the one load. After a load, the oldest items are
evicted while a count or byte budget is exceeded (never the item just loaded); a call that still
holds an evicted item keeps using it until it returns. Every load is recorded as a
``LoadEvent`` (reason ``miss``, ``evict`` for a reload after eviction, ``preload``) that the next
call reports.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from worker.errors import BadRequest, ConfigError, ModelNotFound, ScoringError
from worker.scorer.weights import Holdings, LoadEvent, WeightsKind

log = logging.getLogger(__name__)

MAX_NAME_CHARS = 256


@dataclass(frozen=True)
class WeightsConfig:
    """Where per-job weights live and how many stay resident (0 bytes: no byte budget).

    ``preload``: names loaded at start, ``adapter:NAME`` or ``version:NAME`` (a bare name is
    an adapter).
    """

    adapter_root: str | None = None
    model_root: str | None = None
    max_resident_adapters: int = 8
    max_resident_versions: int = 1
    max_resident_bytes: int = 0
    preload: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("max_resident_adapters", "max_resident_versions", "max_resident_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"WeightsConfig.{name}={value!r}: expected an integer >= 0")
        for root in (self.adapter_root, self.model_root):
            if root is not None and not Path(root).is_dir():
                raise ConfigError(f"weights root {root!r} is not a directory")
        for item in self.preload:
            kind, name = split_preload(item)
            if (self.adapter_root if kind == "adapter" else self.model_root) is None:
                raise ConfigError(
                    f"--preload {item!r} but no --{kind.replace('version', 'model')}-root"
                )
            plain_name(name, kind)

    @property
    def enabled(self) -> bool:
        """Whether any per-job weights can be served."""
        return self.adapter_root is not None or self.model_root is not None


def split_preload(item: str) -> tuple[WeightsKind, str]:
    """``adapter:NAME`` / ``version:NAME`` / ``NAME`` (an adapter) -> ``(kind, name)``."""
    head, sep, rest = item.partition(":")
    if sep and head == "version":
        return "version", rest
    if sep and head == "adapter":
        return "adapter", rest
    return "adapter", item


def plain_name(name: Any, kind: str) -> str:
    """``name`` if it is a plain relative name (``run42/step-120``), else ``BadRequest``."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise BadRequest(f"{kind} must be a non-empty string of at most {MAX_NAME_CHARS} chars")
    parts = PurePosixPath(name).parts
    if (
        name.startswith(("/", "~"))
        or "\\" in name
        or "\x00" in name
        or ":" in name
        or any(p in ("..", ".") for p in name.split("/"))
        or "" in name.split("/")
        or not parts
    ):
        raise BadRequest(f"{kind} {name!r} is not a plain relative name")
    return name


def resolve_under(root: str | None, name: Any, kind: str) -> Path:
    """The directory ``name`` names under ``root`` (see the module docstring for the refusals)."""
    plain_name(name, kind)
    if root is None:
        raise ModelNotFound(f"this worker serves no {kind}s (no --{_flag(kind)}-root)")
    base = Path(root).resolve()
    target = (base / name).resolve()
    if not target.is_relative_to(base) or target == base:
        raise BadRequest(f"{kind} {name!r} resolves outside the {_flag(kind)} root")
    if not target.is_dir():
        raise ModelNotFound(f"no {kind} {name!r} under the {_flag(kind)} root")
    return target


def _flag(kind: str) -> str:
    return "adapter" if kind == "adapter" else "model"


@dataclass
class Resident:
    """One loaded item: its value (an adapter, or a version's executor), size and fingerprint."""

    kind: WeightsKind
    name: str
    value: Any
    nbytes: int
    fingerprint: str


@dataclass
class _Flight:
    done: threading.Event = field(default_factory=threading.Event)
    item: Resident | None = None
    error: BaseException | None = None


Loader = Callable[[str, Path], Resident]


class Residency:
    """Loaded adapters and versions under ``config``'s budget (see the module docstring)."""

    def __init__(self, config: WeightsConfig, loaders: dict[WeightsKind, Loader]) -> None:
        self.config = config
        self._loaders = loaders
        self._lock = threading.Lock()
        self._items: OrderedDict[tuple[str, str], Resident] = OrderedDict()
        self._flights: dict[tuple[str, str], _Flight] = {}
        self._evicted: set[tuple[str, str]] = set()
        self._events: list[LoadEvent] = []
        self._evictions = 0

    def root(self, kind: WeightsKind) -> str | None:
        """The configured root of ``kind``."""
        return self.config.adapter_root if kind == "adapter" else self.config.model_root

    def check(self, kind: WeightsKind, name: str) -> Path:
        """The directory of ``name`` (``BadRequest`` / ``ModelNotFound`` as ``resolve_under``)."""
        return resolve_under(self.root(kind), name, kind)

    def acquire(
        self, kind: WeightsKind, name: str, *, reason: str = "miss"
    ) -> tuple[Resident, bool]:
        """``(item, hit)``: the resident item, loading it first when needed (one load per name)."""
        key = (kind, name)
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
                return item, True
            flight = self._flights.get(key)
            owner = flight is None
            if flight is None:
                flight = self._flights[key] = _Flight()
        if not owner:
            flight.done.wait()
            if flight.error is not None:
                raise flight.error
            assert flight.item is not None
            return flight.item, False
        try:
            flight.item = self._load(kind, name, reason)
            return flight.item, False
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            with self._lock:
                del self._flights[key]
            flight.done.set()

    def _load(self, kind: WeightsKind, name: str, reason: str) -> Resident:
        key = (kind, name)
        with self._lock:
            if reason == "miss" and key in self._evicted:
                reason = "evict"
        started = time.perf_counter()
        try:
            path = self.check(kind, name)
            item = self._loaders[kind](name, path)
        except BaseException as exc:
            outcome = "not_found" if isinstance(exc, ModelNotFound) else "error"
            self._record(LoadEvent(kind, name, reason, outcome, time.perf_counter() - started))
            if isinstance(exc, (ScoringError, KeyboardInterrupt, SystemExit)):
                raise
            raise BadRequest(f"cannot load {kind} {name!r}: {type(exc).__name__}: {exc}") from exc
        seconds = time.perf_counter() - started
        with self._lock:
            self._items[key] = item
            self._evicted.discard(key)
            self._evict_over_budget(keep=key)
            self._events.append(LoadEvent(kind, name, reason, "ok", seconds, item.nbytes))
        log.info("loaded %s %s (%s, %.3f s, %d bytes)", kind, name, reason, seconds, item.nbytes)
        return item

    def _record(self, event: LoadEvent) -> None:
        with self._lock:
            self._events.append(event)

    def _evict_over_budget(self, keep: tuple[str, str]) -> None:
        """Drop least-recently-used items (never ``keep``) while a budget is exceeded."""
        cfg = self.config
        limits = {"adapter": cfg.max_resident_adapters, "version": cfg.max_resident_versions}

        def over() -> list[tuple[str, str]]:
            for kind, limit in limits.items():
                keys = [k for k in self._items if k[0] == kind and k != keep]
                if keys and sum(1 for k in self._items if k[0] == kind) > limit:
                    return keys
            total = sum(i.nbytes for i in self._items.values())
            if cfg.max_resident_bytes and total > cfg.max_resident_bytes:
                return [k for k in self._items if k != keep]
            return []

        while victims := over():
            victim = victims[0]
            self._items.pop(victim)
            self._evicted.add(victim)
            self._evictions += 1
            log.info("evicted %s %s (least recently used)", *victim)

    def holdings(self) -> Holdings:
        """What is resident now."""
        with self._lock:
            items = list(self._items.values())
        return Holdings(
            adapters=tuple(i.name for i in items if i.kind == "adapter"),
            versions=tuple(i.name for i in items if i.kind == "version"),
            bytes=sum(i.nbytes for i in items),
        )

    def summary(self) -> dict[str, Any]:
        """What is resident, as plain data (LRU order, oldest first): per kind, each name's bytes
        and fingerprint; the total bytes and the budget."""
        with self._lock:
            items = list(self._items.values())
        cfg = self.config
        out: dict[str, Any] = {"adapters": {}, "versions": {}}
        for i in items:
            out[f"{i.kind}s"][i.name] = {"bytes": i.nbytes, "fingerprint": i.fingerprint}
        out["bytes"] = sum(i.nbytes for i in items)
        out["budget"] = {
            "adapters": cfg.max_resident_adapters,
            "versions": cfg.max_resident_versions,
            "bytes": cfg.max_resident_bytes,
        }
        return out

    def drain_events(self) -> tuple[tuple[LoadEvent, ...], int]:
        """Load events and the eviction count since the last drain."""
        with self._lock:
            events, self._events = tuple(self._events), []
            evictions, self._evictions = self._evictions, 0
        return events, evictions
