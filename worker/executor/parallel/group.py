"""The two roles of a tensor-parallel group: the leader's ``GroupScorer`` and the followers'
``follow`` loop.

Rank 0 runs the ordinary daemon (``worker.daemon.Worker``, unchanged) with a ``GroupScorer``:
it prepares at intake like any scorer (``prepare``: the leader's plan), and each ``run``
broadcasts the call (the batch as prepared: its ``Prepared`` requests, plans included) before
running it on its own shards. Ranks 1..N-1 run ``follow``: receive a call, run the same
``ParallelExecutor.run`` on the leader's plans, repeat, until the leader sends ``None``. The
collectives each call makes, in order, are listed in ``collectives``.

``StepClock`` says how long this rank has been inside one call; the group's watchdog
(``worker.processes.tp_group``) takes the group down when a call outlives its deadline (a rank
hung in a kernel or in a collective that a dead or stuck peer never joins).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from worker.errors import ScoringError
from worker.executor.parallel.collectives import Comm
from worker.executor.parallel.executor import ParallelExecutor
from worker.modes import Mode
from worker.request import ScoreRequest
from worker.scorer.outputs import FallbackEvent, ScoreOutput
from worker.scorer.plan import DirectScoring, Prepared

log = logging.getLogger(__name__)

__all__ = ["Call", "GroupScorer", "StepClock", "follow"]


@dataclass(frozen=True)
class Call:
    """One ``run`` as the leader broadcasts it: the batch as the leader prepared it."""

    batch: list[Prepared]


class StepClock:
    """When this rank entered the call it is in (``None`` between calls); read by the
    watchdog's thread, written by the scoring thread."""

    def __init__(self) -> None:
        self._since: float | None = None

    def begin(self) -> None:
        """A call starts."""
        self._since = time.monotonic()

    def end(self) -> None:
        """The call is over."""
        self._since = None

    def busy_for(self) -> float | None:
        """Seconds inside the current call, or ``None`` between calls."""
        since = self._since
        return None if since is None else time.monotonic() - since


class GroupScorer(DirectScoring):
    """The leader's ``worker.scorer.Scorer``: ``executor``'s preparation and identity, and a
    ``run`` that broadcasts each call to the followers first (one call at a time)."""

    def __init__(self, executor: ParallelExecutor, comm: Comm, clock: StepClock) -> None:
        if comm.rank != 0:
            raise ValueError("the GroupScorer runs on rank 0")
        self.executor = executor
        self.comm = comm
        self.clock = clock
        self._lock = threading.Lock()  # the group runs one call at a time, in broadcast order
        self._closed = False

    @property
    def modes(self) -> tuple[Mode, ...]:
        """The modes the group serves."""
        return self.executor.modes

    @property
    def vocab_size(self) -> int:
        """Valid token ids are ``[0, vocab_size)`` (the executor's)."""
        return int(self.executor.vocab_size)

    @property
    def max_positions(self) -> int | None:
        """Longest sequence the model accepts (the executor's)."""
        return self.executor.max_positions

    @property
    def info(self) -> dict[str, Any]:
        """The executor's identity, with the group (``tensor_parallel``, its devices)."""
        return self.executor.info

    @property
    def load_fallbacks(self) -> list[FallbackEvent]:
        """Fallbacks taken while loading (the same on every rank)."""
        return self.executor.load_fallbacks

    def add_fallback_listener(self, callback: Callable[[FallbackEvent], None]) -> None:
        """Run-time fallbacks of the leader (every rank takes the same ones)."""
        self.executor.add_fallback_listener(callback)

    def resident(self) -> dict[str, Any]:
        """Nothing beyond the served models (per-job weights are refused under a group)."""
        return {}

    def prepare(self, request: ScoreRequest) -> Prepared:
        """The leader's own preparation (no collective): the followers run its plan."""
        return self.executor.prepare(request)

    def run(self, batch: Sequence[Prepared]) -> ScoreOutput:
        """Broadcast the prepared batch, then run it here: every rank runs it on its shards."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the tensor-parallel group is closed")
            self.clock.begin()
            try:
                self.comm.send_call(Call(list(batch)))
                return self.executor.run(batch)
            finally:
                self.clock.end()

    def close(self) -> None:
        """Stop the followers (they leave ``follow``); the group serves no more calls."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self.comm.send_call(None)


def follow(executor: ParallelExecutor, comm: Comm, clock: StepClock) -> None:
    """A follower's loop: run every call the leader broadcasts, until it sends ``None``.

    A call that fails with a ``ScoringError`` failed alike on the leader, which answers its
    jobs; anything else escaping ``run`` means this rank left the group's step, so the group
    goes down (``Comm.fatal``) and the leader's batch is reclaimed.
    """
    while True:
        call = comm.receive_call()
        if call is None:
            log.info("rank %d: the leader stopped the group", comm.rank)
            return
        clock.begin()
        try:
            executor.run(call.batch)
        except ScoringError as exc:
            log.debug("rank %d: call failed on every rank: %s", comm.rank, exc)
        except Exception as exc:
            comm.fatal(f"rank {comm.rank}: a call failed here: {type(exc).__name__}: {exc}")
        finally:
            clock.end()
