"""The ScaledObject values the simulation recommends, which ``ops/k8s`` ships.

``scoring-worker bench --suite autoscale`` sweeps the grid of :mod:`.sweep` and prints the
setting it picks; ``RECOMMENDED`` is that setting, written down, and
``tests/ops/test_ops_static.py`` checks that ``ops/k8s/keda-scaledobject*.yaml`` carry exactly these
values (the sweep says so when its pick and ``RECOMMENDED`` differ).
"""

from __future__ import annotations

from typing import Any

from worker.devtools.autoscale.hpa import Policy
from worker.devtools.autoscale.keda import ScaledObject

RECOMMENDED = ScaledObject(
    polling_interval_s=15,
    cooldown_s=60,
    min_replicas=0,
    max_replicas=16,
    lag_count=64,  # the composite metric's target: what one worker reads at once (read_count)
    activation_lag_count=0,
    pending_count=64,
    scale_down_window_s=60,
    scale_down_policies=(Policy("Percent", 100, 15),),
    combine="sum",
    partitions=4,
)


def manifest_fields(spec: ScaledObject) -> dict[str, Any]:
    """The ScaledObject's fields as a manifest spells them (what the static test compares)."""
    return {
        "pollingInterval": int(spec.polling_interval_s),
        "cooldownPeriod": int(spec.cooldown_s),
        "minReplicaCount": spec.min_replicas,
        "stabilizationWindowSeconds": int(spec.scale_down_window_s),
        "scaleDownPolicies": [
            {"type": p.kind, "value": p.value, "periodSeconds": int(p.period_s)}
            for p in spec.scale_down_policies
        ],
        # the lag triggers' target, or with combine="sum" the scalingModifiers' target
        "lagCount": str(spec.lag_count),
        "activationLagCount": str(spec.activation_lag_count),
        "pendingEntriesCount": str(spec.pending_count),
    }
