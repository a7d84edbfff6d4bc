"""KEDA's side of a ScaledObject with redis-streams triggers: the metrics, activation, cooldown.

Follows KEDA's ``pkg/scalers/redis_streams_scaler.go`` and its documentation
(https://keda.sh/docs/2.15/scalers/redis-streams/, .../concepts/scaling-deployments/,
.../reference/scaledobject-spec/):

- a trigger with ``consumerGroup`` and ``lagCount`` reports the group's ``lag`` (``XINFO GROUPS``:
  entries no consumer has read yet); with ``consumerGroup`` and no ``lagCount`` it reports the
  group's pending count (``XPENDING``: read, not acked) against ``pendingEntriesCount`` (hence one
  trigger per measure: ``lagCount`` wins when both are set);
- each trigger is *active* while its value is ``> activationLagCount`` (the one activation field
  the scaler reads, default 0, for every measure; the shipped pending triggers set none, so they
  are active while anything is pending);
- every ``pollingInterval`` the operator checks activity: an active ScaledObject at 0 replicas is
  scaled to 1 (the HPA takes it from there); with ``minReplicaCount: 0``, one whose triggers have
  all been inactive for ``cooldownPeriod`` since the last active check is scaled to 0. With
  ``minReplicaCount >= 1`` activation is ignored (the HPA's ``minReplicas`` keeps the pods);
- the HPA KEDA creates has one external ``AverageValue`` metric per trigger with the trigger's
  target (``lagCount`` or ``pendingEntriesCount``), ``minReplicas = max(minReplicaCount, 1)``,
  ``maxReplicas = maxReplicaCount`` and the ScaledObject's ``behavior`` (:mod:`.hpa`). The HPA
  reads the metrics from KEDA's metrics server at its own sync period; ``pollingInterval`` paces
  only the activation checks (metrics are not cached unless a trigger sets ``useCachedMetrics``);
- the HPA takes the largest of its metrics' proposals, so separate lag and pending triggers ask
  for ``max(ceil(lag / lagCount), ceil(pending / pendingEntriesCount))`` pods, not for what holds
  both; ``advanced.scalingModifiers`` (``formula: lag + pending``, ``target``,
  ``activationTarget``) replaces the triggers' metrics with one composite metric (``combine``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from worker.devtools.autoscale.hpa import DEFAULT_SCALE_DOWN, DEFAULT_SCALE_UP, Policy, Rules


@dataclass(frozen=True)
class ScaledObject:
    """The ScaledObject fields the simulation varies (one lag and one pending trigger on one
    stream, as ``ops/k8s/keda-scaledobject.yaml`` ships per partition)."""

    polling_interval_s: float = 30.0
    cooldown_s: float = 300.0
    min_replicas: int = 0
    max_replicas: int = 16
    lag_count: int = 64
    activation_lag_count: int = 0
    pending_count: int | None = 64  # None: no pending trigger
    scale_down_window_s: float = 300.0
    scale_down_policies: tuple[Policy, ...] = DEFAULT_SCALE_DOWN.policies
    scale_up: Rules = DEFAULT_SCALE_UP
    combine: str = "max"  # "max": one HPA metric per trigger; "sum": scalingModifiers lag + pending
    partitions: int = 1  # partition streams, each with its own lag and pending trigger

    def __post_init__(self) -> None:
        if self.lag_count <= 0 or (self.pending_count is not None and self.pending_count <= 0):
            raise ValueError("lagCount and pendingEntriesCount must be > 0")
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"need 0 <= minReplicaCount <= maxReplicaCount >= 1: {self}")
        if self.polling_interval_s <= 0 or self.cooldown_s < 0:
            raise ValueError("pollingInterval must be > 0 and cooldownPeriod >= 0")
        if self.partitions < 1:
            raise ValueError(f"partitions must be >= 1: {self}")
        if self.combine not in ("max", "sum") or (self.combine == "sum" and not self.pending_count):
            raise ValueError(f"combine is 'max' or 'sum' (with a pending trigger): {self}")

    @property
    def scale_down(self) -> Rules:
        """The HPA's ``behavior.scaleDown``."""
        return Rules(self.scale_down_window_s, self.scale_down_policies)

    @property
    def hpa_min_replicas(self) -> int:
        """The ``minReplicas`` of the HPA KEDA creates."""
        return max(self.min_replicas, 1)

    def metrics(self, lag: int, pending: int) -> list[tuple[float, float]]:
        """``(value, target)`` of each external metric the HPA reads, from the queue's total lag
        and pending entries spread evenly over the partitions: one metric per trigger (the
        partitions' triggers read ``1 / partitions`` each, and the HPA takes the largest), or
        with ``combine="sum"`` the one composite metric of KEDA's ``scalingModifiers``, the sum
        of every trigger's value (``formula``) against ``target`` = lagCount."""
        if self.combine == "sum":
            return [(float(lag + pending), float(self.lag_count))]
        out = [(lag / self.partitions, float(self.lag_count))]
        if self.pending_count is not None:
            out.append((pending / self.partitions, float(self.pending_count)))
        return out

    def active(self, lag: int, pending: int) -> bool:
        """True when some trigger is active: a lag trigger while its lag is
        ``> activationLagCount``, a pending trigger (no activation field set, so 0) while
        anything is pending; the composite metric while it is ``> activationTarget``."""
        if self.combine == "sum":
            return lag + pending > self.activation_lag_count
        busiest = math.ceil(lag / self.partitions)
        return busiest > self.activation_lag_count or (
            self.pending_count is not None and pending > 0
        )


@dataclass
class Operator:
    """The KEDA operator's scale loop for one ScaledObject (called every ``pollingInterval``)."""

    spec: ScaledObject
    last_active_s: float | None = None

    def check(self, now: float, replicas: int, lag: int, pending: int) -> int | None:
        """The replica count KEDA sets now (``None``: leaves it to the HPA)."""
        active = self.spec.active(lag, pending)
        if active:
            self.last_active_s = now
            if replicas == 0:
                return 1
            return None
        if self.spec.min_replicas > 0 or replicas == 0:
            return None
        since = self.last_active_s
        if since is None or now - since >= self.spec.cooldown_s:
            return 0
        return None
