"""Does anyone serve the queue? The one rule every producer applies before it writes a job.

* A queue with a live worker, or with a consumer group on a job stream (it has been served and
  will be again: scale from zero, a restart, a fleet still loading), is **known**: jobs are added
  and wait for a worker within the caller's timeout; a ``ScoringTimeout`` then says whether a
  worker served the queue during the wait.
* A queue with neither (a typo, or a fleet that has never started) is **unknown**: the submit is
  refused at once with ``UnknownQueueError``, naming the queues the server holds, and nothing is
  written. ``wait_for_unknown_queue=True`` adds the jobs anyway (a fleet that creates its group
  on first start), with one warning.

Redis commands, all read-only: ``ZCOUNT scoring:{q}:workers <now> +inf`` (live heartbeats,
``worker.streams.heartbeat``); while none is live, ``XINFO GROUPS`` on each job stream until one
has a group; for a refusal, ``SCAN MATCH scoring:{*}:jobs`` / ``scoring:{*}:workers`` (bounded).
A server that refuses a command (an ACL without it) cannot say: the queue is not refused.
A known queue stays known for the client's life; an unknown one is asked again at each submit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import redis

from worker import keys
from worker.client.effects import Command, Steps
from worker.client.errors import UnknownQueueError

log = logging.getLogger(__name__)

#: ``SCAN`` rounds per pattern when a refusal lists the queues (1000 keys looked at per round).
MAX_SCAN_ROUNDS = 20


@dataclass(frozen=True)
class QueueState:
    """What the server says about a queue."""

    #: Workers with a live heartbeat (None: the server would not say).
    live: int | None
    #: Whether a job stream has a consumer group (None: not asked, or the server would not say).
    served: bool | None

    @property
    def known(self) -> bool | None:
        """True when a worker serves the queue or did (a group); False when neither; None when
        the server would not say."""
        if self.live:
            return True
        return self.served

    def to_json(self) -> dict[str, Any]:
        """``{known, live_workers, consumer_group}`` (the gateway's ``/health``)."""
        return {"known": self.known, "live_workers": self.live, "consumer_group": self.served}


class WorkerCheck:
    """The queue rule for one client (see the module docstring). ``enabled=False``: never
    asked, never refused (an ACL without the commands, or a caller that checks on its own)."""

    def __init__(
        self,
        queue: str,
        streams: list[str] | None = None,
        *,
        enabled: bool = True,
        wait_unknown: bool = False,
    ) -> None:
        self.queue = queue
        self.streams = list(streams or keys.job_streams(queue))
        self.enabled = enabled
        self.wait_unknown = wait_unknown
        self.admitted = not enabled  # a submit may write (the queue was known, or may be waited)
        self.checked = False
        self.live: int | None = (
            None  # the last count (None: not asked, or the server would not say)
        )

    def count(self, refresh: bool = False) -> Steps[int | None]:
        """How many workers have a live heartbeat on the queue; ``None`` when the server will
        not say. Cached after the first call (``refresh`` asks again)."""
        if self.checked and not refresh:
            return self.live
        self.checked = True
        index = keys.workers_index(self.queue)
        try:
            live = int((yield Command("zcount", (index, f"{time.time():.3f}", "+inf"))))
        except redis.ResponseError as exc:  # NOPERM: the check is a courtesy, never an error
            log.debug("cannot count the workers of queue %r: %s", self.queue, exc)
            self.live = None
            return None
        self.live = live
        return live

    def has_group(self) -> Steps[bool | None]:
        """Whether any job stream of the queue has a consumer group (``XINFO GROUPS``); None when
        the server will not say."""
        for stream in self.streams:
            try:
                groups = yield Command("xinfo_groups", (stream,))
            except redis.ResponseError as exc:
                if "no such key" in str(exc).lower():
                    continue  # no stream: no group on it
                log.debug("cannot list the groups of %s: %s", stream, exc)
                return None
            if groups:
                return True
        return False

    def state(self) -> Steps[QueueState]:
        """The queue's state now: live workers and, while none is live, whether it has a group."""
        live = yield from self.count(refresh=True)
        if live:
            return QueueState(live, None)
        return QueueState(live, (yield from self.has_group()))

    def admit(self) -> Steps[None]:
        """Before a submit writes anything: refuse an unknown queue (``UnknownQueueError``)
        unless ``wait_unknown``; a known queue is not asked again."""
        if self.admitted:
            return
        state = yield from self.state()
        if state.known is False:
            if not self.wait_unknown:
                raise UnknownQueueError(self.queue, (yield from self.list_queues()))
            log.warning(
                "no worker serves queue %r and none ever did (no consumer group): jobs wait for "
                "a fleet that creates its group on first start (wait_for_unknown_queue); if "
                "none does, check the queue name ('scoring-worker info --list')",
                self.queue,
            )
        elif state.live == 0:
            log.info(
                "no worker serves queue %r now (it has a consumer group): jobs wait for one "
                "(scale from zero, a restart)",
                self.queue,
            )
        self.admitted = True

    def list_queues(self) -> Steps[list[str] | None]:
        """The queues the server holds a job stream or a workers index for (``SCAN``, bounded;
        on Cluster the first round of each node); None when the server will not say."""
        found: set[str] = set()
        try:
            for pattern in keys.QUEUE_KEY_PATTERNS:
                cursor: Any = 0
                for _ in range(MAX_SCAN_ROUNDS):
                    cursor, names = yield Command(
                        "scan", (cursor,), {"match": pattern, "count": 1000}
                    )
                    for name in names:
                        text = name.decode() if isinstance(name, bytes) else str(name)
                        queue = keys.queue_of_key(text)
                        if queue:
                            found.add(queue)
                    if isinstance(cursor, dict) or not int(cursor):
                        break  # done (a Cluster's per-node cursors: its first round only)
        except redis.ResponseError as exc:  # NOPERM: the refusal just cannot name them
            log.debug("cannot list the queues: %s", exc)
            return None
        return sorted(found - {self.queue})

    def timeout_hint(self) -> Steps[str | None]:
        """What a ``ScoringTimeout`` says beside the job: whether a worker serves the queue now
        (``None``: the usual question)."""
        if not self.enabled:
            return None
        try:
            live = yield from self.count(refresh=True)
        except redis.RedisError:  # Redis away: the timeout is the news, not this
            return None
        if live == 0:
            return (
                f"no worker served queue {self.queue!r} within the wait (none has a live "
                f"heartbeat now); start one with 'scoring-worker serve --queue {self.queue}'"
            )
        return None


__all__ = ["QueueState", "WorkerCheck"]
