"""Producer-side at-least-once, without I/O: which jobs are due to be added again.

A job whose result has not arrived ``after_s`` seconds after its last ``XADD`` is added again, same
id and same payload, up to ``max_submits`` ``XADD`` commands in all. Harmless when the first copy
was not lost: the worker scores it again and the client drops the second result by job id. It
recovers what Redis itself cannot: a job ``XADD``-ed to a primary that died before its replica got
it, a result lost with a primary after its job was acked. See docs/guarantees.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from worker import errors


@dataclass
class _Tracked:
    job: Any  # the PreparedJob (stream, payload)
    submits: int
    last_at: float


class Resubmitter:
    """The jobs that may be added again, and when (monotonic seconds)."""

    def __init__(self, after_s: float | None, max_submits: int) -> None:
        if after_s is not None and after_s <= 0:
            raise errors.ConfigError("resubmit_after_s must be > 0 (or None: off)")
        if max_submits < 1:
            raise errors.ConfigError("max_submits must be >= 1")
        self.after_s = after_s
        self.max_submits = max_submits
        self._jobs: dict[str, _Tracked] = {}
        self.resubmits = 0  # XADDs after the first, in all

    @property
    def enabled(self) -> bool:
        """Whether jobs are ever added again."""
        return self.after_s is not None and self.max_submits > 1

    def track(self, job_id: str, job: Any, now: float) -> None:
        """``job`` was just added (the first time)."""
        if self.enabled:
            self._jobs[job_id] = _Tracked(job, 1, now)

    def done(self, job_id: str) -> None:
        """The job's result arrived, or the job was forgotten."""
        self._jobs.pop(job_id, None)

    def due(self, job_ids: Iterable[str], now: float) -> list[tuple[str, Any]]:
        """The jobs among ``job_ids`` to add again now (their count and clock move on)."""
        out = []
        for job_id in job_ids:
            t = self._jobs.get(job_id)
            if t is None or self.after_s is None or now - t.last_at < self.after_s:
                continue
            t.submits += 1
            t.last_at = now
            out.append((job_id, t.job))
            if t.submits >= self.max_submits:
                del self._jobs[job_id]  # the last copy: nothing more to do for it
        self.resubmits += len(out)
        return out

    def retry_later(self, job_id: str, job: Any, now: float) -> None:
        """Adding it again failed (Redis away): try again after another interval, uncounted."""
        if self.after_s is None:
            return
        t = self._jobs.get(job_id)
        if t is None:
            self._jobs[job_id] = _Tracked(job, self.max_submits - 1, now)
        else:
            t.submits -= 1
            t.last_at = now
        self.resubmits -= 1

    def next_due(self, job_ids: Iterable[str]) -> float | None:
        """When the first of ``job_ids`` falls due (None: never)."""
        if self.after_s is None:
            return None
        times = [t.last_at for j in job_ids if (t := self._jobs.get(j)) is not None]
        return min(times) + self.after_s if times else None

    def __len__(self) -> int:
        return len(self._jobs)
