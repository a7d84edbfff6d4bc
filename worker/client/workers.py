"""Is a worker serving the queue? The producer's check at its first submit.

``WorkerCheck.count`` sends ``ZCOUNT scoring:{q}:workers <now> +inf``: the workers whose heartbeat
(``worker.streams.heartbeat``) has not expired. The answer is cached for the client's life; a
count of 0 logs one warning (a typo in the queue name, or no worker started yet: the jobs wait),
and a ``ScoringTimeout`` then says so too. A server that refuses the command (an ACL without
``+zcount``) gets no check and no warning.
"""

from __future__ import annotations

import logging
import time

import redis

from worker import keys
from worker.client.effects import Command, Steps

log = logging.getLogger(__name__)


class WorkerCheck:
    """The live-worker count of one queue, asked once (``checked``) and kept (``live``)."""

    def __init__(self, queue: str, *, enabled: bool = True) -> None:
        self.queue = queue
        self.checked = not enabled  # disabled: as if asked, with no answer
        self.live: int | None = None  # None: not asked, or the server would not say

    def count(self, refresh: bool = False) -> Steps[int | None]:
        """How many workers have a live heartbeat on the queue; ``None`` when the server will
        not say. Cached after the first call (``refresh`` asks again, without the warning)."""
        if self.checked and not refresh:
            return self.live
        self.checked = True
        index = keys.workers_index(self.queue)
        try:
            live = int((yield Command("zcount", (index, f"{time.time():.3f}", "+inf"))))
        except redis.ResponseError as exc:  # NOPERM: the check is a courtesy, never an error
            log.debug("cannot count the workers of queue %r: %s", self.queue, exc)
            return None
        self.live = live
        if live == 0 and not refresh:
            log.warning(
                "no worker serves queue %r (none has a live heartbeat in %s): jobs wait "
                "until one does; start one with 'scoring-worker serve --queue %s', or check the "
                "queue name ('scoring-worker info --list' lists the queues there are); a fleet "
                "that scales from zero starts on this job (check_workers=False: no check)",
                self.queue,
                index,
                self.queue,
            )
        return live

    def timeout_hint(self) -> str | None:
        """What a ``ScoringTimeout`` says beside the job when no worker served the queue at the
        first submit (``None``: the usual question)."""
        if self.live == 0:
            return (
                f"no worker served queue {self.queue!r} when the first job was submitted; "
                f"start one with 'scoring-worker serve --queue {self.queue}'"
            )
        return None


__all__ = ["WorkerCheck"]
