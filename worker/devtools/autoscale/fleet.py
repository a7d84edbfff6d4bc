"""The queueing core: one job stream with its consumer group, and workers that serve it in batches.

The model follows the daemon (``worker/daemon/worker.py``, ``backlog.py``), not an ideal queue:

- **reads**: an idle worker blocks on the stream (``XREADGROUP ... BLOCK``); Redis serves blocked
  readers one entry each, first blocked first, as entries arrive. A worker then *fills*: it reads
  about what completes one batch's token budget by the mean job size seen (``read_count``, 64 in
  all over the partitions, before any job was seen), without blocking, until its backlog holds
  the budget, waiting at most ``max_wait_s`` for more when the stream is empty. So one worker
  holds about one batch beyond the one it computes (its first read up to 64 entries): workers
  that start later find what the earlier ones did not take;
- **batches**: the oldest held job plus each following one that fits the token budget; a batch
  costs ``batch_overhead_s + s_per_token * tokens`` (tokens: every token of every sequence);
- **pipelining**: while a batch computes, the worker reads ahead what fills its backlog to one
  budget (by the mean job size seen) and starts the next batch the moment the current one ends;
- **start and stop**: a pod is counted (and costs) from creation; it serves after ``startup_s``
  (model load to ``/readyz``). A stopped worker stops reading, hands back what it holds but has
  not started (they go to the other workers at once) and finishes the batch computing, then
  exits (``hand_back=False``: it finishes everything it holds); one stopped while starting or
  idle exits at once. Kubernetes removes not-ready pods
  first, then the most recently ready (the ReplicaSet controller's order).

Lag is the stream's undelivered entries, pending the entries read and not acked: the two values
KEDA's redis-streams triggers read.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import simpy

from worker.daemon.backlog import read_size

Process = Generator[simpy.Event, Any, None]
"""A SimPy process generator."""


@dataclass(frozen=True)
class Profile:
    """One worker's measured figures and the daemon's batching settings."""

    s_per_token: float
    startup_s: float
    batch_overhead_s: float = 0.0
    max_batch_tokens: int = 16384
    read_count: int = 64
    max_wait_s: float = 0.005
    hand_back: bool = True  # a stopping worker gives back what it has not started (--handback)
    sized_reads: bool = True  # reads sized by the mean job size (False: read_count every time)

    def __post_init__(self) -> None:
        if self.s_per_token < 0 or self.startup_s < 0 or self.batch_overhead_s < 0:
            raise ValueError(f"costs and start-up must be >= 0: {self}")
        if self.max_batch_tokens <= 0 or self.read_count <= 0:
            raise ValueError(f"max_batch_tokens and read_count must be > 0: {self}")

    def batch_s(self, tokens: int) -> float:
        """Seconds one batch of ``tokens`` tokens takes."""
        return self.batch_overhead_s + self.s_per_token * tokens


@dataclass
class Job:
    """One job: its size, when it was added, and when its result was written."""

    id: int
    tokens: int
    added_s: float
    step: int = 0
    done_s: float | None = None


class Stream:
    """A job stream and its consumer group: undelivered entries (lag), pending count, readers."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.undelivered: deque[Job] = deque()
        self.pending = 0
        self._blocked: deque[tuple[simpy.Event, int]] = deque()
        self.on_done: list[Callable[[Job], None]] = []

    @property
    def lag(self) -> int:
        """Entries no worker has read (``XINFO GROUPS`` lag)."""
        return len(self.undelivered)

    def add(self, job: Job) -> None:
        """``XADD``: a blocked reader gets it at once, else it waits in the stream."""
        if self._blocked:
            event, _count = self._blocked.popleft()
            self.pending += 1
            event.succeed([job])
        else:
            self.undelivered.append(job)

    def add_many(self, jobs: list[Job]) -> None:
        """``MULTI`` + one ``XADD`` per job + ``EXEC``: blocked readers are served after the
        transaction, first blocked first, each with up to its read's count; the rest waits."""
        jobs = list(jobs)
        while jobs and self._blocked:
            event, count = self._blocked.popleft()
            got, jobs = jobs[:count], jobs[count:]
            self.pending += len(got)
            event.succeed(got)
        self.undelivered.extend(jobs)

    def hand_back(self, jobs: list[Job]) -> None:
        """A stopping worker's unstarted entries, claimable by the others at once (the daemon's
        hand-back: ``XCLAIM ... IDLE``, watched by every serving worker): ahead of the rest."""
        self.pending -= len(jobs)
        self.undelivered.extendleft(reversed(jobs))
        while self.undelivered and self._blocked:
            event, count = self._blocked.popleft()
            got = self.read(count)
            event.succeed(got)

    def read(self, count: int) -> list[Job]:
        """``XREADGROUP COUNT count`` without BLOCK: up to ``count`` entries (maybe none)."""
        n = min(count, len(self.undelivered))
        out = [self.undelivered.popleft() for _ in range(n)]
        self.pending += n
        return out

    def read_blocking(self, count: int) -> simpy.Event:
        """``XREADGROUP ... BLOCK``: an event whose value is the entries read."""
        event = self.env.event()
        if self.undelivered:
            event.succeed(self.read(count))
        else:
            self._blocked.append((event, count))
        return event

    def cancel(self, event: simpy.Event) -> None:
        """Stop waiting on a blocked read (a reader that exits)."""
        self._blocked = deque(b for b in self._blocked if b[0] is not event)

    def ack(self, jobs: list[Job]) -> None:
        """Result written and entry acked, for each job."""
        self.pending -= len(jobs)
        for job in jobs:
            job.done_s = self.env.now
            for callback in self.on_done:
                callback(job)


def take_batch(backlog: list[Job], budget: int) -> list[Job]:
    """The oldest job plus each following one that fits ``budget`` tokens (``Backlog``)."""
    batch: list[Job] = []
    rest: list[Job] = []
    tokens = 0
    for job in backlog:
        if not batch or tokens + job.tokens <= budget:
            batch.append(job)
            tokens += job.tokens
        else:
            rest.append(job)
    backlog[:] = rest
    return batch


class Worker:
    """One worker pod: starts, then reads, batches and scores until stopped."""

    def __init__(
        self,
        env: simpy.Environment,
        stream: Stream,
        profile: Profile,
        on_exit: Callable[[Worker], None],
    ) -> None:
        self.env, self.stream, self.profile = env, stream, profile
        self.created_s = env.now
        self.ready_s: float | None = None
        self.exited_s: float | None = None
        self.stopping = False
        self.backlog: list[Job] = []
        self.batches = 0
        self._on_exit = on_exit
        self._mean_tokens = 0.0
        self._waiting: simpy.Event | None = None
        self.process = env.process(self._run())

    def stop(self) -> None:
        """SIGTERM: stop reading, hand back what is held but not started (``hand_back``; else
        finish it), finish the batch computing, exit (at once when starting or idle)."""
        self.stopping = True
        if self.profile.hand_back and self.backlog:
            held, self.backlog = self.backlog, []
            self.stream.hand_back(held)
        if self.ready_s is None or self._waiting is not None:
            self.process.interrupt()

    def _held_tokens(self) -> int:
        return sum(j.tokens for j in self.backlog)

    def _take(self, jobs: list[Job]) -> None:
        for job in jobs:
            m = self._mean_tokens
            self._mean_tokens = job.tokens if m == 0 else 0.9 * m + 0.1 * job.tokens
        self.backlog.extend(jobs)

    def _room(self) -> int:
        """Entries to read now: about what completes the budget by the mean job size seen
        (``Backlog.rooms``), ``read_count`` before any job was seen."""
        count = self.profile.read_count
        if not self.profile.sized_reads:
            return count
        left = self.profile.max_batch_tokens - self._held_tokens()
        return read_size(left, self._mean_tokens, count, ahead=False) if left > 0 else count

    def _fill(self) -> None:
        budget = self.profile.max_batch_tokens
        while budget - self._held_tokens() > 0:
            got = self.stream.read(self._room())
            if not got:
                return
            self._take(got)

    def _read_ahead(self) -> None:
        left = self.profile.max_batch_tokens - self._held_tokens()
        if left <= 0 or self.stopping:
            return
        count = read_size(left, self._mean_tokens, self.profile.read_count, ahead=True)
        self._take(self.stream.read(count))

    def _run(self) -> Process:
        p = self.profile
        try:
            yield self.env.timeout(p.startup_s)
        except simpy.Interrupt:
            return self._exit()
        self.ready_s = self.env.now
        while True:
            if not self.backlog:
                if self.stopping:
                    break
                waiting = self._waiting = self.stream.read_blocking(self._room())
                try:
                    got = yield waiting
                except simpy.Interrupt:
                    if not waiting.triggered:
                        self.stream.cancel(waiting)
                        break
                    got = waiting.value  # handed an entry just before the stop: serve it
                finally:
                    self._waiting = None
                self._take(got)
            if not self.stopping:
                self._fill()
                if self._held_tokens() < p.max_batch_tokens and p.max_wait_s > 0:
                    yield self.env.timeout(p.max_wait_s)
                    self._fill()
            batch = take_batch(self.backlog, p.max_batch_tokens)
            self._read_ahead()
            yield self.env.timeout(p.batch_s(sum(j.tokens for j in batch)))
            self.batches += 1
            self.stream.ack(batch)
        self._exit()

    def _exit(self) -> None:
        self.exited_s = self.env.now
        self._on_exit(self)


class Fleet:
    """The Deployment's pods: scaled to a replica count, with the pod-seconds they cost."""

    def __init__(self, env: simpy.Environment, stream: Stream, profile: Profile) -> None:
        self.env, self.stream, self.profile = env, stream, profile
        self.pods: list[Worker] = []  # counted in the Deployment's replicas
        self.alive = 0  # pods that exist (terminating ones included): what costs
        self.alive_log: list[tuple[float, int]] = [(env.now, 0)]
        self.created = 0

    @property
    def replicas(self) -> int:
        """The Deployment's replica count (pods not terminating)."""
        return len(self.pods)

    @property
    def ready(self) -> int:
        """Pods that serve (``/readyz``)."""
        return sum(1 for w in self.pods if w.ready_s is not None)

    def scale_to(self, n: int) -> None:
        """Create or stop pods until ``n`` are counted."""
        while len(self.pods) < n:
            self.alive += 1
            self.created += 1
            self.alive_log.append((self.env.now, self.alive))
            self.pods.append(Worker(self.env, self.stream, self.profile, self._exited))
        while len(self.pods) > n:
            victim = self._victim()
            self.pods.remove(victim)
            victim.stop()

    def _victim(self) -> Worker:
        starting = [w for w in self.pods if w.ready_s is None]
        if starting:
            return max(starting, key=lambda w: w.created_s)
        return max(self.pods, key=lambda w: w.ready_s or 0.0)

    def _exited(self, worker: Worker) -> None:
        self.alive -= 1
        self.alive_log.append((self.env.now, self.alive))

    def pod_seconds(self, start_s: float, end_s: float) -> float:
        """Pod-seconds spent in ``[start_s, end_s]`` (every existing pod, starting and
        terminating ones included)."""
        total = 0.0
        log = [*self.alive_log, (end_s, self.alive)]
        for (t0, n), (t1, _) in itertools.pairwise(log):
            lo, hi = max(t0, start_s), min(t1, end_s)
            if hi > lo:
                total += n * (hi - lo)
        return total
