"""The compute stage: one batch scores on its own thread while the main thread talks to Redis.

:class:`BatchPipeline` owns a compute thread fed through a one-slot hand-off: the main thread
:meth:`~BatchPipeline.submit`\\ s a batch when the stage is idle, keeps reading, decoding and
validating the next batch and writing and acking the previous one, and
:meth:`~BatchPipeline.take_done`\\ s the replies once the forward returns. At most one batch
computes and (because the worker reads ahead only until its backlog holds one batch's token
budget) at most one more is prepared ahead, so leases and memory stay bounded.

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
from collections.abc import Callable

from worker.daemon.context import Pending, Reply

log = logging.getLogger(__name__)

#: Scores one batch into one reply per job (``functools.partial(score_batch, ctx)``).
ScoreFn = Callable[[list[Pending]], list[Reply]]


class BatchPipeline:
    """At most one batch computing (on a compute thread, or inline), its replies handed back."""

    def __init__(self, score: ScoreFn, *, threaded: bool = True) -> None:
        self._score = score
        self.threaded = threaded
        self._inbox: queue.Queue[list[Pending] | None] = queue.Queue(maxsize=1)
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._batch: list[Pending] | None = None  # submitted, replies not yet taken
        self._suspect = False
        self._replies: list[Reply] | None = None
        self._error: BaseException | None = None
        self.started_s: float | None = None  # monotonic start of the batch computing now
        self._thread: threading.Thread | None = None  # started on the first submit

    # ------------------------------------------------------------------ main thread
    @property
    def busy(self) -> bool:
        """True from :meth:`submit` until the batch's replies are taken."""
        return self._batch is not None

    @property
    def computing(self) -> bool:
        """True while the submitted batch has not finished computing."""
        return self._batch is not None and not self._done.is_set()

    @property
    def suspect_running(self) -> bool:
        """True while the batch held here is a suspect running alone (see ``Backlog``)."""
        return self._batch is not None and self._suspect

    def held_ids(self) -> set[tuple[str, str]]:
        """``(stream, entry_id)`` of the batch held here (computing, or replies not taken)."""
        batch = self._batch
        return {(p.entry.stream, p.entry.id) for p in batch} if batch else set()

    def submit(self, batch: list[Pending], *, suspect: bool = False) -> None:
        """Start scoring ``batch`` (inline when not threaded). The stage must not be busy.
        ``suspect``: the batch is a suspect running alone (the worker reads nothing ahead)."""
        if self._batch is not None:
            raise RuntimeError("a batch is already held by the compute stage")
        self._batch = batch
        self._suspect = suspect
        self._done.clear()
        if not self.threaded:
            self._compute(batch)
            return
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="compute", daemon=True)
            self._thread.start()
        self._inbox.put_nowait(batch)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the batch to finish; True when it has (or none is held)."""
        if self._batch is None:
            return True
        return self._done.wait(timeout_s)

    def take_done(self) -> list[Reply] | None:
        """The finished batch's replies (the stage is then idle), or None while it computes.

        An error the compute step raised (``score_batch`` answers scorer failures itself, so
        this is a bug) is raised here, in the main thread, after the stage is freed.
        """
        if self._batch is None or not self._done.is_set():
            return None
        with self._lock:
            replies, error = self._replies, self._error
            self._batch, self._replies, self._error = None, None, None
        if error is not None:
            raise error
        return replies or []

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the compute thread (after the batch it runs, if any)."""
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
        replies: list[Reply] | None = None
        error: BaseException | None = None
        self.started_s = time.monotonic()
        try:
            replies = self._score(batch)
        except Exception as exc:  # handed to the main thread, which logs and releases
            error = exc
        finally:
            self.started_s = None
        with self._lock:
            self._replies, self._error = replies, error
        self._done.set()
