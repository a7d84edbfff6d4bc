"""The backlog: decoded jobs this worker holds, waiting for a batch, and how a batch is taken.

A batch is the oldest job plus the following jobs of the same ``(mode, temperature)`` that fit in
``max_batch_tokens``. A *suspect* (an entry delivered more than ``isolate_after_deliveries`` times:
its batch never finished, so it may crash the worker) always runs alone.
"""

from __future__ import annotations

from collections.abc import Iterator

from worker.daemon.context import Pending


class Backlog:
    """Pending jobs in arrival order, with token accounting and batch taking."""

    def __init__(self, *, max_batch_tokens: int, isolate_after_deliveries: int) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.isolate_after = isolate_after_deliveries
        self._items: list[Pending] = []

    def append(self, pending: Pending) -> None:
        """Queue a job at the end."""
        self._items.append(pending)

    def tokens(self) -> int:
        """Tokens held, over every job."""
        return sum(p.job.num_tokens for p in self._items)

    def full(self) -> bool:
        """True once the held jobs reach the token budget of one batch."""
        return self.tokens() >= self.max_batch_tokens

    def is_suspect(self, pending: Pending) -> bool:
        """True for a job that must run alone (delivered more than the isolation limit)."""
        return pending.entry.deliveries > self.isolate_after

    def holds_suspect(self) -> bool:
        """True while a suspect waits here (the reader then claims no other)."""
        return any(self.is_suspect(p) for p in self._items)

    def held_ids(self) -> set[tuple[str, str]]:
        """``(stream, entry_id)`` of every job held."""
        return {(p.entry.stream, p.entry.id) for p in self._items}

    def take_batch(self) -> list[Pending]:
        """Remove and return the next batch (empty when nothing is held)."""
        if not self._items:
            return []
        first = self._items[0]
        if self.is_suspect(first):
            # Delivered again after its batch never finished (the worker died mid-batch): it
            # runs alone, so a job that crashes the process cannot take batch-mates with it to
            # the dead-letter stream.
            del self._items[0]
            return [first]
        key = first.key
        batch: list[Pending] = []
        rest: list[Pending] = []
        tokens = 0
        for p in self._items:
            if self.is_suspect(p):
                rest.append(p)
                continue
            n = p.job.num_tokens
            if p.key == key and (not batch or tokens + n <= self.max_batch_tokens):
                batch.append(p)
                tokens += n
            else:
                rest.append(p)
        self._items = rest
        return batch

    def take_all(self) -> list[Pending]:
        """Remove and return every job held, oldest first (a draining worker hands them back)."""
        items, self._items = self._items, []
        return items

    def put_front(self, items: list[Pending]) -> None:
        """Hold ``items`` again ahead of the rest, in their order (a hand-back that failed)."""
        self._items[:0] = items

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Pending]:
        return iter(list(self._items))
