"""The HorizontalPodAutoscaler's algorithm for external ``AverageValue`` metrics (KEDA's HPA).

Follows Kubernetes' ``pkg/controller/podautoscaler`` (``replica_calculator.go``:
``GetExternalPerPodMetricReplicas``; ``horizontal.go``: ``stabilizeRecommendationWithBehaviors``,
``convertDesiredReplicasWithBehaviorRate``, ``calculateScaleUpLimitWithScalingRules``,
``calculateScaleDownLimitWithBehaviors``) and the defaults of
https://kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/:

- per metric: ``ratio = value / (target * current)``; within the tolerance (0.1) the proposal is
  ``current``, else ``ceil(value / target)``; the largest proposal over the metrics wins;
- stabilization: the recommendation is held between the *lowest* proposal of the scale-up window
  (default 0 s) and the *highest* of the scale-down window (default 300 s);
- rate limits: each policy allows ``Pods`` (``start + value``) or ``Percent``
  (``ceil(start * (1 + value/100))`` up, ``floor(start * (1 - value/100))`` down) per
  ``periodSeconds``, ``start`` being the replicas at the start of the period (current minus what
  was added in it plus what was removed); ``selectPolicy: Max`` takes the policy that allows the
  biggest change (the default), ``Min`` the smallest, ``Disabled`` none;
- defaults: scale up ``max(4 pods, 100%)`` per 15 s with no window; scale down 100% per 15 s with a
  300 s window.

Pure functions and one small state object; the SimPy loop that calls it every sync period is in
:mod:`worker.devtools.autoscale.sim`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TOLERANCE = 0.1
"""``--horizontal-pod-autoscaler-tolerance`` (kube-controller-manager's default)."""
SYNC_PERIOD_S = 15.0
"""``--horizontal-pod-autoscaler-sync-period``: how often the HPA reads its metrics and acts."""


@dataclass(frozen=True)
class Policy:
    """One HPA scaling policy: ``Pods`` or ``Percent`` ``value`` per ``period_s``."""

    kind: str  # "Pods" | "Percent"
    value: int
    period_s: float

    def __post_init__(self) -> None:
        if self.kind not in ("Pods", "Percent") or self.value <= 0 or self.period_s <= 0:
            raise ValueError(f"bad HPA policy {self}")


@dataclass(frozen=True)
class Rules:
    """``behavior.scaleUp`` or ``behavior.scaleDown``: window, policies, selectPolicy."""

    stabilization_s: float
    policies: tuple[Policy, ...]
    select: str = "Max"  # "Max" | "Min" | "Disabled"


DEFAULT_SCALE_UP = Rules(0.0, (Policy("Percent", 100, 15.0), Policy("Pods", 4, 15.0)))
DEFAULT_SCALE_DOWN = Rules(300.0, (Policy("Percent", 100, 15.0),))


def metric_proposal(current: int, value: float, target: float, tolerance: float = TOLERANCE) -> int:
    """The replicas one external ``AverageValue`` metric asks for (``current`` > 0)."""
    if target <= 0:
        raise ValueError(f"target must be > 0, got {target}")
    ratio = value / (target * current)
    if abs(1.0 - ratio) <= tolerance:
        return current
    return math.ceil(value / target)


def _change_in_period(events: list[tuple[float, int]], now: float, period_s: float) -> int:
    return sum(change for at, change in events if at > now - period_s)


@dataclass
class HpaState:
    """What one HPA remembers between syncs: its recent recommendations and scale events."""

    min_replicas: int
    max_replicas: int
    scale_up: Rules = DEFAULT_SCALE_UP
    scale_down: Rules = DEFAULT_SCALE_DOWN
    recommendations: list[tuple[float, int]] = field(default_factory=list)
    up_events: list[tuple[float, int]] = field(default_factory=list)
    down_events: list[tuple[float, int]] = field(default_factory=list)

    def _stabilize(self, now: float, current: int, desired: int) -> int:
        up_cut = now - self.scale_up.stabilization_s
        down_cut = now - self.scale_down.stabilization_s
        up_rec = desired
        down_rec = desired
        for at, rec in self.recommendations:
            if at > up_cut:
                up_rec = min(up_rec, rec)
            if at > down_cut:
                down_rec = max(down_rec, rec)
        keep = max(self.scale_up.stabilization_s, self.scale_down.stabilization_s)
        self.recommendations = [(t, r) for t, r in self.recommendations if t > now - keep]
        self.recommendations.append((now, desired))
        return min(max(current, up_rec), down_rec)

    def _start(self, now: float, current: int, period_s: float) -> int:
        added = _change_in_period(self.up_events, now, period_s)
        removed = _change_in_period(self.down_events, now, period_s)
        return current - added + removed

    def _limit(self, now: float, current: int, up: bool) -> int:
        """The most (``up``) or fewest replicas the rate limits of that direction allow now:
        each policy's limit from the period's start; ``selectPolicy: Max`` takes the policy
        that allows the biggest change, ``Min`` the smallest, ``Disabled`` none."""
        rules = self.scale_up if up else self.scale_down
        if rules.select == "Disabled":
            return current
        sign = 1 if up else -1
        limits = []
        for p in rules.policies:
            start = self._start(now, current, p.period_s)
            if p.kind == "Pods":
                limits.append(start + sign * p.value)
            elif up:
                limits.append(math.ceil(start * (1 + p.value / 100)))
            else:
                limits.append(int(start * (1 - p.value / 100)))
        biggest_change = max if up else min
        smallest_change = min if up else max
        return (smallest_change if rules.select == "Min" else biggest_change)(limits)

    def decide(self, now: float, current: int, desired: int) -> int:
        """The replicas the HPA sets at ``now`` from the metrics' ``desired`` (records the
        recommendation and, when it changes the count, the scale event)."""
        rec = self._stabilize(now, current, desired)
        out = rec
        if rec > current:
            limit = max(self._limit(now, current, up=True), current)
            out = min(rec, limit, self.max_replicas)
        elif rec < current:
            limit = min(self._limit(now, current, up=False), current)
            out = max(rec, limit, self.min_replicas)
        out = min(max(out, self.min_replicas), self.max_replicas)
        self.record(now, current, out)
        return out

    def record(self, now: float, before: int, after: int) -> None:
        """Remember a change the HPA made to the replica count, for the rate limits (KEDA's own
        0 <-> 1 changes are not among the HPA's events)."""
        longest = max(p.period_s for p in (*self.scale_up.policies, *self.scale_down.policies))
        self.up_events = [(t, c) for t, c in self.up_events if t > now - longest]
        self.down_events = [(t, c) for t, c in self.down_events if t > now - longest]
        if after > before:
            self.up_events.append((now, after - before))
        elif after < before:
            self.down_events.append((now, before - after))
