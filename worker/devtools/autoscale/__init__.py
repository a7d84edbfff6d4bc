"""The autoscaling simulation: KEDA's redis-streams scaler and the HPA in front of a fleet serving
an RL workload (SimPy), its check against real workers, and the settings it recommends.

``keda`` (the ScaledObject: trigger metrics, activation, cooldown), ``hpa`` (the HPA algorithm),
``fleet`` (the stream and the workers: the queueing core), ``workload`` (RL steps), ``sim`` (one
run), ``sweep`` (the grid, the pick; ``scoring-worker bench --suite autoscale``), ``report``
(tables, plots), ``check`` (the core against real noop workers), ``recommended`` (what ops/k8s
ships). See docs/operations.md, "Autoscaling settings".
"""
