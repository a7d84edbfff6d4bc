"""The compute stage: one batch scores on its own thread while the main thread talks to Redis.

:class:`BatchPipeline` owns a compute thread fed through a one-slot queue: the main thread
submits a batch, keeps reading, decoding and validating the next one (queued in the slot once it
fills a batch's token budget, so the compute thread starts it the moment the forward returns)
and writes and acks the previous one's replies (:meth:`~BatchPipeline.take_done`). At most one
batch computes and one is prepared ahead (queued, or filling the backlog while the slot is free),
so leases and memory stay bounded.

Only the main thread touches the loop's Redis client; the compute thread calls
:func:`worker.daemon.jobs.score_batch` and nothing else. With ``threaded=False`` the same object
runs each batch inline inside :meth:`submit` (``--no-pipeline``): the daemon's sequential loop of
before, kept for comparison.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from worker.daemon.context import Pending, Reply

log = logging.getLogger(__name__)

#: Scores one batch into one reply per job (``functools.partial(score_batch, ctx)``).
ScoreFn = Callable[[list[Pending]], list[Reply]]


class BatchPipeline:
    """A compute stage: at most one batch computing and one queued behind it, replies handed back.

    The queued batch lets the compute thread go from one forward straight to the next without
    waiting for the main thread to wake up (on a loaded machine a thread wake-up costs
    milliseconds per batch). Replies of finished batches wait in order until taken.
    """

    def __init__(self, score: ScoreFn, *, threaded: bool = True) -> None:
        self._score = score
        self.threaded = threaded
        self._inbox: queue.Queue[list[Pending] | None] = queue.Queue(maxsize=1)
        self._ready = threading.Event()  # set while finished batches wait to be taken
        self._lock = threading.Lock()
        self._queued: list[Pending] | None = None  # submitted, not started
        self._running: list[Pending] | None = None  # computing now
        self._finished: deque[tuple[list[Pending], list[Reply] | None, Exception | None]] = deque()
        self._suspects: set[int] = set()  # id() of held batches that are suspects
        self.started_s: float | None = None  # monotonic start of the batch computing now
        self._thread: threading.Thread | None = None  # started on the first submit

    # ------------------------------------------------------------------ main thread
    @property
    def busy(self) -> bool:
        """True while any batch is held here (queued, computing, or replies not taken)."""
        with self._lock:
            return bool(self._queued or self._running or self._finished)

    @property
    def computing(self) -> bool:
        """True while a batch is queued or computing."""
        with self._lock:
            return bool(self._queued or self._running)

    @property
    def queued(self) -> bool:
        """True while a batch waits behind the one computing (the slot is taken)."""
        with self._lock:
            return self._queued is not None

    @property
    def suspect_running(self) -> bool:
        """True while a suspect (see ``Backlog``) is queued or computing here."""
        with self._lock:
            return any(id(b) in self._suspects for b in (self._queued, self._running) if b)

    def held_ids(self) -> set[tuple[str, str]]:
        """``(stream, entry_id)`` of every batch held (queued, computing, replies not taken)."""
        with self._lock:
            batches = [self._queued, self._running, *(f[0] for f in self._finished)]
        return {(p.entry.stream, p.entry.id) for b in batches if b for p in b}

    def can_take(self, *, suspect: bool = False) -> bool:
        """True when a batch can be submitted now: the slot is free, and a suspect (which runs
        alone) only when nothing computes, and nothing behind a suspect."""
        with self._lock:
            if self._queued is not None:
                return False
            if self._running is not None:
                return not suspect and id(self._running) not in self._suspects
            return True

    def submit(self, batch: list[Pending], *, suspect: bool = False) -> None:
        """Queue ``batch`` (run it inline when not threaded); ``can_take`` must be True.
        ``suspect``: the batch is a suspect running alone (nothing is queued behind it)."""
        if not self.can_take(suspect=suspect):
            raise RuntimeError("the compute stage cannot take a batch now")
        with self._lock:
            self._queued = batch
            if suspect:
                self._suspects.add(id(batch))
        if not self.threaded:
            self._compute(batch)
            return
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="compute", daemon=True)
            self._thread.start()
        self._inbox.put_nowait(batch)

    def take_queued(self) -> list[Pending]:
        """Take back the batch queued behind the computing one, if the compute thread has not
        started it (empty: none, or it started); a draining worker hands its jobs back."""
        with self._lock:
            if self._queued is None or not self.threaded:
                return []
            try:
                batch = self._inbox.get_nowait()
            except queue.Empty:  # the compute thread took it and is about to start it
                return []
            if batch is None:  # a close() in the slot: nothing was queued after all
                self._inbox.put_nowait(None)
                return []
            self._queued = None
            self._suspects.discard(id(batch))
            return batch

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a batch to finish; True when replies wait to be taken."""
        return self._ready.wait(timeout_s)

    def take_done(self) -> list[Reply] | None:
        """Replies of the finished batches, oldest first (None when none finished).

        An error the compute step raised (``score_batch`` answers scorer failures itself, so
        this is a bug) is raised here, in the main thread, once the batches before it are taken.
        """
        out: list[Reply] = []
        with self._lock:
            while self._finished:
                batch, replies, error = self._finished[0]
                if error is not None and out:
                    break  # hand back what is done first; the error comes out next time
                self._finished.popleft()
                self._suspects.discard(id(batch))
                if error is not None:
                    if not self._finished:
                        self._ready.clear()
                    raise error
                out.extend(replies or [])
            if not self._finished:
                self._ready.clear()
            taken = bool(out)
        return out if taken else None

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the compute thread (after the batches it holds, if any)."""
        thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            try:
                self._inbox.put(None, timeout=timeout_s)
            except queue.Full:
                return
            thread.join(timeout_s)

    # ------------------------------------------------------------------ compute thread
    def _run(self) -> None:
        while True:
            batch = self._inbox.get()
            if batch is None:
                return
            self._compute(batch)

    def _compute(self, batch: list[Pending]) -> None:
        with self._lock:
            self._queued, self._running = None, batch
        replies: list[Reply] | None = None
        error: Exception | None = None
        self.started_s = time.monotonic()
        try:
            replies = self._score(batch)
        except Exception as exc:  # handed to the main thread, which logs and releases
            error = exc
        finally:
            self.started_s = None
        with self._lock:
            self._running = None
            self._finished.append((batch, replies, error))
            self._ready.set()
