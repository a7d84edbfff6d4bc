"""One simulated run: the RL trainer, the stream, the fleet, KEDA's operator and the HPA in SimPy.

``simulate`` runs a workload under a ScaledObject and returns what the trainer and the fleet
saw; ``replay`` runs a fixed arrival trace through a fixed number of ready workers (the queueing
core alone, which :mod:`.check` compares with real workers).

Time line of the control loops: KEDA's operator checks activation every ``pollingInterval``
(0 <-> 1), the HPA syncs every 15 s (1 <-> N), each from t = 0 with its own phase; a new pod
serves ``startup_s`` after it is created.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import simpy

from worker.devtools.autoscale.fleet import Fleet, Job, Process, Profile, Stream
from worker.devtools.autoscale.hpa import SYNC_PERIOD_S, HpaState, metric_proposal
from worker.devtools.autoscale.keda import Operator, ScaledObject
from worker.devtools.autoscale.workload import RlWorkload, Trainer

STRANDED_AFTER_S = 3600.0
"""A step whose scores take longer than this (beyond its generation phase) counts as stranded."""


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between the closest ranks (numpy's default)."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


@dataclass
class Sample:
    """The state at one instant (for the plots)."""

    t: float
    replicas: int
    ready: int
    lag: int
    pending: int


@dataclass
class RunResult:
    """What one simulated run gives, over its steady steps (every step but the first)."""

    wait_s: float  # mean trainer wait per step
    wait_max_s: float
    p50_s: float  # job latency
    p99_s: float
    pod_s_per_step: float
    scale_events_per_step: float
    cold_starts_per_step: float
    step_s: float  # mean wall time of a step (generation + wait)
    samples: list[Sample] = field(default_factory=list)
    events: list[tuple[float, int, int, str]] = field(default_factory=list)
    stranded: bool = False  # some job never got its result (the run did not finish)

    def cost(self, trainer_devices: float) -> float:
        """Device-seconds per step: the fleet's pods plus the trainer's devices while they wait
        (infinite when the run stranded jobs)."""
        if self.stranded:
            return math.inf
        return self.pod_s_per_step + trainer_devices * self.wait_s


class Control:
    """KEDA's operator and the HPA acting on one fleet."""

    def __init__(
        self,
        env: simpy.Environment,
        fleet: Fleet,
        spec: ScaledObject,
        phase: float = 0.5,
        hpa_sync_s: float = SYNC_PERIOD_S,
    ) -> None:
        self.env, self.fleet, self.spec = env, fleet, spec
        self.operator = Operator(spec)
        self.hpa = HpaState(
            spec.hpa_min_replicas, spec.max_replicas, spec.scale_up, spec.scale_down
        )
        self.events: list[tuple[float, int, int, str]] = []
        fleet.scale_to(spec.min_replicas)
        env.process(self._keda(spec.polling_interval_s, phase * spec.polling_interval_s))
        env.process(self._hpa(hpa_sync_s, phase * hpa_sync_s))

    def _set(self, n: int, who: str) -> None:
        before = self.fleet.replicas
        if n != before:
            self.events.append((self.env.now, before, n, who))
            self.fleet.scale_to(n)

    def _keda(self, every_s: float, first_s: float) -> Process:
        yield self.env.timeout(first_s)
        while True:
            s = self.fleet.stream
            n = self.operator.check(self.env.now, self.fleet.replicas, s.lag, s.pending)
            if n is not None:
                self._set(n, "keda")
            yield self.env.timeout(every_s)

    def _hpa(self, every_s: float, first_s: float) -> Process:
        yield self.env.timeout(first_s)
        while True:
            current = self.fleet.replicas
            s = self.fleet.stream
            if current == 0:  # "scaling is disabled since the replica count of the target is zero"
                yield self.env.timeout(every_s)
                continue
            desired = max(
                metric_proposal(current, value, target)
                for value, target in self.spec.metrics(s.lag, s.pending)
            )
            self._set(self.hpa.decide(self.env.now, current, desired), "hpa")
            yield self.env.timeout(every_s)


def _sampler(env: simpy.Environment, fleet: Fleet, out: list[Sample], every_s: float) -> Process:
    while True:
        s = fleet.stream
        out.append(Sample(env.now, fleet.replicas, fleet.ready, s.lag, s.pending))
        yield env.timeout(every_s)


def simulate(
    spec: ScaledObject,
    workload: RlWorkload,
    profile: Profile,
    *,
    phase: float = 0.5,
    trace: bool = False,
    sample_s: float = 1.0,
) -> RunResult:
    """Run ``workload`` on a fleet under ``spec``; ``trace`` keeps samples for the plots.
    ``phase`` (0-1): where in its period each control loop first runs."""
    env = simpy.Environment()
    stream = Stream(env)
    fleet = Fleet(env, stream, profile)
    control = Control(env, fleet, spec, phase)
    trainer = Trainer(env, stream, workload)
    samples: list[Sample] = []
    if trace:
        env.process(_sampler(env, fleet, samples, sample_s))
    limit_s = (workload.steps + 1) * (workload.gen_s + STRANDED_AFTER_S)
    env.run(until=simpy.AnyOf(env, [trainer.process, env.timeout(limit_s)]))
    stranded = trainer.process.is_alive
    steady = trainer.steps[1 : workload.steps]
    if len(steady) < workload.steps - 1 or any(st.done_s == 0 for st in steady):
        inf = math.inf
        return RunResult(
            inf,
            inf,
            inf,
            inf,
            inf,
            inf,
            inf,
            inf,
            samples=samples,
            events=control.events,
            stranded=True,
        )
    start, end = steady[0].gen_start_s, steady[-1].done_s
    n = len(steady)
    latencies = [j.done_s - j.added_s for st in steady for j in st.jobs if j.done_s is not None]
    waits = [st.wait_s for st in steady]
    in_window = [e for e in control.events if start <= e[0] <= end]
    created = sum(max(0, after - before) for _t, before, after, _w in in_window)
    return RunResult(
        wait_s=statistics.fmean(waits),
        wait_max_s=max(waits),
        p50_s=percentile(latencies, 50),
        p99_s=percentile(latencies, 99),
        pod_s_per_step=fleet.pod_seconds(start, end) / n,
        scale_events_per_step=len(in_window) / n,
        cold_starts_per_step=created / n,
        step_s=(end - start) / n,
        samples=samples,
        events=control.events,
        stranded=stranded,
    )


def mean_result(runs: Sequence[RunResult]) -> RunResult:
    """The mean of runs of one setting at several phases (samples and events of the first)."""
    if len(runs) == 1:
        return runs[0]
    skip = ("samples", "events", "stranded")
    names = [f for f in RunResult.__dataclass_fields__ if f not in skip]
    values = {f: statistics.fmean(getattr(r, f) for r in runs) for f in names}
    values["wait_max_s"] = max(r.wait_max_s for r in runs)
    return RunResult(
        **values,
        samples=runs[0].samples,
        events=runs[0].events,
        stranded=any(r.stranded for r in runs),
    )


def replay(arrivals: Sequence[tuple[float, int]], replicas: int, profile: Profile) -> list[float]:
    """Latency of each job of a trace ``[(added_s, tokens)]`` (sorted) through ``replicas``
    ready workers at a fixed count; in the trace's order. Jobs with the same ``added_s`` arrive
    in one transaction (``Stream.add_many``)."""
    env = simpy.Environment()
    stream = Stream(env)
    fleet = Fleet(env, stream, Profile(**{**profile.__dict__, "startup_s": 0.0}))
    fleet.scale_to(replicas)
    jobs = [Job(i, tokens, t) for i, (t, tokens) in enumerate(arrivals)]
    offset = 1.0 - min(t for t, _ in arrivals)  # workers are blocked on the stream first

    def producer() -> Process:
        for job in jobs:
            job.added_s += offset
        for at, burst in itertools.groupby(jobs, key=lambda j: j.added_s):
            if at > env.now:
                yield env.timeout(at - env.now)
            stream.add_many(list(burst))

    done = env.process(producer())
    env.run(until=done)
    while stream.pending or stream.lag:
        env.step()
    return [j.done_s - j.added_s for j in jobs if j.done_s is not None]
