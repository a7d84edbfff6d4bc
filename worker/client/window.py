"""``score_many``'s window, without I/O: at most ``max_in_flight`` jobs submitted and not yet
answered, each with its own deadline counted from its submission.

``ScoreWindow.next`` is an operation of the core (it yields effects, see ``worker.client.core``):
it tops the window up from the job source, then waits for the head job (``ordered``) or any job,
in slices of at most ``_WAIT_SLICE_S`` so that no wait is ever given an unbounded timeout. A job
Redis refuses for memory stops the call at once: ``QueueFullError`` says how many of its jobs
were written before it (whatever ``raise_errors``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterable, Iterable
from typing import Any

from worker.client.core import ClientCore, new_job_id
from worker.client.effects import END, NextItem, Steps
from worker.client.errors import (
    BadRequestError,
    JobFailed,
    QueueFullError,
    client_checks,
    job_failed,
)
from worker.client.inputs import JobSpec, as_job_spec, with_defaults
from worker.client.results import ScoreResult

log = logging.getLogger(__name__)

_WAIT_SLICE_S = 60.0  # score_many waits in slices of this (timeout=None waits forever)


class ScoreWindow:
    """The jobs of one ``score_many`` call in flight, and what comes next."""

    def __init__(
        self,
        core: ClientCore,
        jobs: Iterable[Any] | AsyncIterable[Any],
        max_in_flight: int,
        ordered: bool,
        timeout: float | None,
        mode: str | None,
        temperature: float,
        raise_errors: bool,
        defaults: JobSpec | None = None,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.core = core
        self.source = jobs.__aiter__() if isinstance(jobs, AsyncIterable) else iter(jobs)
        self.max_in_flight = max_in_flight
        self.ordered = ordered
        self.timeout = timeout
        self.mode = mode
        self.temperature = temperature
        self.raise_errors = raise_errors
        # teacher outputs and step for jobs that set none (score_many's keyword arguments)
        self.defaults = defaults or JobSpec(seqs=None)
        self.exhausted = False
        # job id -> (submitted at, deadline), both monotonic
        self.pending: OrderedDict[str, tuple[float, float]] = OrderedDict()
        # jobs refused before sending (raise_errors off): answered in their turn
        self.refused: dict[str, JobFailed] = {}
        self.written = 0  # jobs of this call added to their stream

    def next(self) -> Steps[ScoreResult | JobFailed | None]:
        """The next result (None when every job is answered). Raises ``ScoringTimeout`` when the
        job waited for is past its deadline, and a failed job's ``JobFailed`` unless
        ``raise_errors`` is off (it is returned then)."""
        yield from self._fill()
        if not self.pending:
            return None
        head, (head_start, head_deadline) = next(iter(self.pending.items()))
        refused = head if self.ordered else next(iter(self.refused), None)
        if refused in self.refused:
            del self.pending[refused]
            return self.refused.pop(refused)
        while True:  # bounded slices: no wait is ever passed an infinite timeout
            wait_s = min(head_deadline - time.monotonic(), _WAIT_SLICE_S)
            ids = [head] if self.ordered else list(self.pending)
            got = yield from self.core.wait_any(ids, max(wait_s, 0.0))
            if got is not None:
                break
            now = time.monotonic()
            if now >= head_deadline:
                raise (yield from self.core.timeout(head, now - head_start))
        job_id, raw = got
        del self.pending[job_id]
        if raw.ok:
            return ScoreResult.from_wire(raw)
        failed = job_failed(raw)
        if self.raise_errors:
            raise failed
        return failed

    def _fill(self) -> Steps[None]:
        """Submit jobs from the source until the window is full or the source is exhausted."""
        while not self.exhausted and len(self.pending) < self.max_in_flight:
            item = yield NextItem(self.source)
            if item is END:
                self.exhausted = True
                break
            with client_checks(getattr(item, "job_id", None) or "(score_many item)"):
                spec = as_job_spec(item)
            mode = spec.mode or self.mode or self.core.mode
            spec = with_defaults(spec, self.defaults, mode)
            job_id = spec.job_id or new_job_id()
            try:
                job = self.core.prepare(
                    spec.seqs,
                    mode,
                    spec.temperature if spec.temperature is not None else self.temperature,
                    deadline_ms=spec.deadline_ms,
                    meta=spec.meta,
                    job_id=job_id,
                    adapter=spec.adapter,
                    version=spec.version,
                    outputs=spec.teacher(),
                    step=spec.step,
                    options=spec.options,
                    images=spec.images,
                    processor=spec.processor,
                )
            except BadRequestError as exc:  # refused here, never sent: answered in its turn
                if self.raise_errors:
                    raise
                now = time.monotonic()
                self.pending[job_id] = (now, now)
                self.refused[job_id] = exc
                continue
            try:
                handle = yield from self.core.submit(job)
            except QueueFullError as exc:  # Redis is full: stop here, say what went in
                in_flight = tuple(j for j in self.pending if j not in self.refused)
                full = exc.counted(self.written, in_flight)
                full.meta = spec.meta
                raise full from exc.__cause__
            self.written += 1
            start = handle.submitted_at
            limit = math.inf if self.timeout is None else start + self.timeout
            self.pending[handle.job_id] = (start, limit)

    def close(self) -> None:
        """Forget the jobs still in flight (the caller stopped early); callers lock."""
        if self.pending:
            log.debug("score_many stopped with %d jobs in flight: forgotten", len(self.pending))
            for job_id in self.pending:
                self.core.forget(job_id)
            self.pending.clear()
            self.refused.clear()
