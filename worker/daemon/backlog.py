"""The backlog: decoded jobs this worker holds, waiting for a batch, and how a batch is taken.

A batch is jobs of one ``(mode, temperature, options)`` key that fit in ``max_batch_tokens``,
each counted by what its scorer computes (``Pending.tokens``: a shared prefix once). A
*suspect* (an entry delivered more than ``isolate_after_deliveries`` times: its batch never
finished, so it may crash the worker) always runs alone.

Jobs are held per queue (a *lane*; one lane for a worker of one queue, whatever its partitions).
The lanes share the batches by weight, as weighted fair queueing over tokens: each lane keeps a
virtual time, the tokens it was given divided by its weight. A batch starts with the head job of
the lane whose virtual time is lowest (its key is the batch's key; a suspect there runs alone);
the batch then grows one job at a time, each time from the lane with the lowest virtual time that
still has a job of that key which fits. So while every lane is backlogged, lane ``i`` gets
``weight_i / sum(weights)`` of the tokens (within one job, batch after batch); a lane with
nothing to give leaves its share to the others, and a lane that was idle starts again at the
lowest virtual time of the lanes still backlogged (or the last batch's), so idleness earns no
credit to spend later.
With one lane this is the oldest job plus the following jobs of its key that fit, in order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from worker.daemon.config import QueueShare
from worker.daemon.context import Pending


@dataclass
class Lane:
    """The jobs one queue has in the backlog, with its weight and virtual time."""

    name: str
    weight: int = 1
    items: list[Pending] = field(default_factory=list)
    vtime: float = 0.0  # tokens given to this lane / weight
    mean_tokens: float = 0.0  # running mean of a job's tokens (sizes reads ahead)

    def tokens(self) -> int:
        """Tokens held in this lane."""
        return sum(p.tokens for p in self.items)


class Backlog:
    """Pending jobs per queue, in arrival order, with token accounting and weighted batch taking."""

    def __init__(
        self,
        *,
        max_batch_tokens: int,
        isolate_after_deliveries: int,
        shares: Sequence[QueueShare] = (),
    ) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.isolate_after = isolate_after_deliveries
        specs = list(shares) or [QueueShare("default", ("*",))]
        self.lanes = [Lane(q.name, q.weight) for q in specs]
        self._floor = 0.0  # the virtual time of the last batch's lead lane
        self._lane_of = {
            s: lane for q, lane in zip(specs, self.lanes, strict=True) for s in q.streams
        }

    def lane_of(self, stream: str) -> Lane:
        """The lane of job stream ``stream`` (the first lane for a stream of no queue)."""
        return self._lane_of.get(stream, self.lanes[0])

    def append(self, pending: Pending) -> None:
        """Queue a job at the end of its queue's lane."""
        lane = self.lane_of(pending.entry.stream)
        if not lane.items:  # back from idle: no credit for the time it had nothing
            busy = [other.vtime for other in self.lanes if other.items]
            lane.vtime = max(lane.vtime, min(busy) if busy else self._floor)
        lane.items.append(pending)
        n, mean = pending.tokens, lane.mean_tokens
        lane.mean_tokens = n if mean == 0 else 0.9 * mean + 0.1 * n

    def tokens(self) -> int:
        """Tokens held, over every job."""
        return sum(lane.tokens() for lane in self.lanes)

    def full(self) -> bool:
        """True once the held jobs reach the token budget of one batch."""
        return self.tokens() >= self.max_batch_tokens

    def is_suspect(self, pending: Pending) -> bool:
        """True for a job that must run alone (delivered more than the isolation limit)."""
        return pending.entry.deliveries > self.isolate_after

    def holds_suspect(self) -> bool:
        """True while a suspect waits here (the reader then claims no other)."""
        return any(self.is_suspect(p) for p in self)

    def held_ids(self) -> set[tuple[str, str]]:
        """``(stream, entry_id)`` of every job held."""
        return {(p.entry.stream, p.entry.id) for p in self}

    def _lead(self) -> Lane | None:
        """The backlogged lane whose turn it is (lowest virtual time; ties: the first lane)."""
        busy = [lane for lane in self.lanes if lane.items]
        return min(busy, key=lambda lane: lane.vtime) if busy else None

    def head(self) -> Pending | None:
        """The job the next batch starts with (None when nothing is held)."""
        lead = self._lead()
        return lead.items[0] if lead is not None else None

    def rooms(self, room: int, *, ahead: bool, queued: bool = False) -> dict[str, int]:
        """How many entries to read per lane, each at most ``room``. ``ahead`` (a batch
        computes): about what fills the lane to one batch's token budget by its mean job size
        (nothing while a batch is ``queued``), so a bursting queue's read-ahead never crowds
        out another's. Otherwise ``room``, but none for a lane holding a batch's budget
        already when there are several (one lane: always ``room``)."""
        out: dict[str, int] = {}
        for lane in self.lanes:
            left = self.max_batch_tokens - lane.tokens()
            if ahead:
                fresh = left > 0 and not queued
                out[lane.name] = read_size(left, lane.mean_tokens, room, ahead=True) if fresh else 0
            elif left <= 0:
                out[lane.name] = 0 if len(self.lanes) > 1 else room
            else:
                out[lane.name] = read_size(left, lane.mean_tokens, room, ahead=False)
        return out

    def take_batch(self) -> list[Pending]:
        """Remove and return the next batch (empty when nothing is held)."""
        lead = self._lead()
        if lead is None:
            return []
        self._floor = max(self._floor, lead.vtime)
        first = lead.items[0]
        if self.is_suspect(first):
            # Delivered again after its batch never finished (the worker died mid-batch): it
            # runs alone, so a job that crashes the process cannot take batch-mates with it to
            # the dead-letter stream.
            del lead.items[0]
            lead.vtime += first.tokens / lead.weight
            return [first]
        key = first.key
        cursor = {id(lane): 0 for lane in self.lanes}
        taken: dict[int, set[int]] = {id(lane): set() for lane in self.lanes}
        batch: list[Pending] = []
        tokens = 0

        def next_fit(lane: Lane) -> int | None:
            """Index of ``lane``'s next job that may join the batch (None: none left)."""
            i = cursor[id(lane)]
            while i < len(lane.items):
                p = lane.items[i]
                fits = not batch or tokens + p.tokens <= self.max_batch_tokens
                if fits and p.key == key and not self.is_suspect(p):
                    break
                i += 1  # another key, a suspect or too big now: never fits this batch
            cursor[id(lane)] = i
            return i if i < len(lane.items) else None

        while True:
            best: tuple[float, int, Lane, int] | None = None
            for order, lane in enumerate(self.lanes if batch else [lead]):
                i = next_fit(lane)
                if i is not None and (best is None or (lane.vtime, order) < best[:2]):
                    best = (lane.vtime, order, lane, i)
            if best is None:
                break
            _, _, lane, i = best
            p = lane.items[i]
            batch.append(p)
            taken[id(lane)].add(i)
            cursor[id(lane)] = i + 1
            tokens += p.tokens
            lane.vtime += p.tokens / lane.weight
        for lane in self.lanes:
            gone = taken[id(lane)]
            if gone:
                lane.items = [p for i, p in enumerate(lane.items) if i not in gone]
        return batch

    def counts(self) -> dict[str, tuple[int, int]]:
        """``{queue: (jobs, tokens)}`` held now, per lane."""
        return {lane.name: (len(lane.items), lane.tokens()) for lane in self.lanes}

    def take_all(self) -> list[Pending]:
        """Remove and return every job held, oldest read first (a draining worker hands them
        back); the lanes' virtual times stay as they are."""
        items = [p for lane in self.lanes for p in lane.items]
        for lane in self.lanes:
            lane.items = []
        return sorted(items, key=lambda p: p.read_at_s)

    def put_front(self, items: list[Pending]) -> None:
        """Hold ``items`` again ahead of the rest of their lanes, in their order (a hand-back
        that failed)."""
        for lane in self.lanes:
            mine = [p for p in items if self.lane_of(p.entry.stream) is lane]
            lane.items[:0] = mine

    def __len__(self) -> int:
        return sum(len(lane.items) for lane in self.lanes)

    def __bool__(self) -> bool:
        return any(lane.items for lane in self.lanes)

    def __iter__(self) -> Iterator[Pending]:
        return iter([p for lane in self.lanes for p in lane.items])


def read_size(left: int, mean_tokens: float, room: int, *, ahead: bool) -> int:
    """How many entries to read (at most ``room``) for a lane with ``left`` > 0 tokens of a
    batch's budget free, by its mean job size ``mean_tokens`` (0: none seen yet). ``ahead`` (a
    batch computes): about what fills the budget, at least one (one entry before any job was
    seen). Otherwise about what completes it, one job past it so the batch is full then
    (``room`` before any job was seen): a worker holds one batch, not ``room`` jobs that other
    workers could start. The autoscaling simulation's workers read by the same rule."""
    if mean_tokens <= 0:
        return 1 if ahead else room
    fit = int(left // mean_tokens) if ahead else math.ceil(left / mean_tokens)
    return min(room, max(1, fit))


def batch_share(
    batch: Sequence[Pending], queue_of: Callable[[str], str]
) -> dict[str, tuple[int, int]]:
    """``{queue: (jobs, tokens)}`` of one batch (``queue_of``: a job stream's queue)."""
    out: dict[str, tuple[int, int]] = {}
    for p in batch:
        queue = queue_of(p.entry.stream)
        jobs, tokens = out.get(queue, (0, 0))
        out[queue] = (jobs + 1, tokens + p.tokens)
    return out
