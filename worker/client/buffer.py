"""The client's reply buffer: results by job id, duplicates dropped, memory bounded."""

from __future__ import annotations

import logging
from collections import OrderedDict

from worker.protocol import Result

log = logging.getLogger(__name__)

#: Job ids remembered for duplicate suppression (taken or forgotten ones).
DELIVERED_MEMORY = 100_000
#: Results kept for job ids this client is not waiting for (not submitted by it, e.g. picked up by a
#: restarted producer with a fixed ``client_id``); past this the oldest are dropped.
MAX_UNCLAIMED_RESULTS = 10_000


class ReplyBuffer:
    """Results by job id, with duplicate suppression and bounded memory. Not thread-safe; callers
    lock.

    ``ready``: arrived, not taken yet. ``delivered``: the last ``remember`` job ids taken or
    forgotten (a later result for one is a duplicate). ``abandoned``: forgotten jobs whose result
    has not arrived (the last ``remember``); their result is dropped on arrival and counted in
    ``late``. ``unclaimed``: buffered results nobody was waiting for (``offer(expected=False)``),
    at most ``max_unclaimed``, the oldest dropped first (counted in ``evicted``).
    """

    def __init__(
        self, remember: int = DELIVERED_MEMORY, max_unclaimed: int = MAX_UNCLAIMED_RESULTS
    ) -> None:
        self.ready: dict[str, Result] = {}
        self.delivered: OrderedDict[str, None] = OrderedDict()
        self.abandoned: OrderedDict[str, None] = OrderedDict()
        self.unclaimed: OrderedDict[str, None] = OrderedDict()
        self.remember = remember
        self.max_unclaimed = max_unclaimed
        self.duplicates = 0
        self.late = 0
        self.evicted = 0
        self.abandoned_overflow = False  # some abandoned ids were forgotten for good

    @property
    def awaiting_late(self) -> bool:
        """Whether results of abandoned jobs may still arrive."""
        return bool(self.abandoned) or self.abandoned_overflow

    def _remember(self, job_id: str) -> None:
        self.delivered[job_id] = None
        while len(self.delivered) > self.remember:
            self.delivered.popitem(last=False)

    def offer(self, result: Result, expected: bool = True) -> bool:
        """Buffer ``result``; False when it is dropped: a duplicate (its job id was already seen,
        counted in ``duplicates``) or the late result of an abandoned job (counted in ``late``).
        ``expected=False``: nobody waits for this job id, so it counts against ``max_unclaimed``."""
        job_id = result.id
        if job_id in self.abandoned:
            del self.abandoned[job_id]
            self._remember(job_id)
            self.late += 1
            log.debug("dropped the late result of abandoned job %s", job_id)
            return False
        if job_id in self.ready or job_id in self.delivered:
            self.duplicates += 1
            log.debug("dropped duplicate result for job %s", job_id)
            return False
        self.ready[job_id] = result
        if not expected:
            self.unclaimed[job_id] = None
            while len(self.unclaimed) > self.max_unclaimed:
                oldest, _ = self.unclaimed.popitem(last=False)
                self.ready.pop(oldest, None)
                self.evicted += 1
                log.warning("dropped the unclaimed result of job %s (buffer full)", oldest)
        return True

    def take(self, job_id: str) -> Result | None:
        """Remove and return the result of ``job_id`` if it has arrived."""
        result = self.ready.pop(job_id, None)
        if result is not None:
            self.unclaimed.pop(job_id, None)
            self._remember(job_id)
        return result

    def forget(self, job_id: str, outstanding: bool) -> bool:
        """Drop ``job_id``'s buffered result, or, when it is ``outstanding`` and its result has not
        arrived, mark it abandoned so that result is dropped on arrival. True if anything was
        dropped or marked."""
        if self.ready.pop(job_id, None) is not None:
            self.unclaimed.pop(job_id, None)
            self._remember(job_id)
            return True
        if not outstanding:
            return False
        self.abandoned[job_id] = None
        while len(self.abandoned) > self.remember:
            self.abandoned.popitem(last=False)
            self.abandoned_overflow = True
        return True
