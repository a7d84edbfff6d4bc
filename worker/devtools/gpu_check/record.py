"""How a GPU-check step runs and reports: where it runs (``Setup``), its figures file
(``StepReport``, rewritten on every ``put`` so a step stopped at its time limit still leaves what
it had measured), its deadline, and its two outcomes besides success (``Skip``, ``CheckFailed``).

A step runs against its own deadline, a little inside the limit the runner kills it at: a
watchdog thread of ``StepReport`` ends the process there with a record saying so, even while the
main thread is stuck in a compile or a kernel. An optional part of a step (``optional``) has a
deadline of its own: past it the part is recorded as "not measured" and the step ends as passed
with what it had. Standard library only.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any


class Skip(Exception):
    """The step cannot run on this machine (the reason is the message)."""


class CheckFailed(Exception):
    """A measured figure broke its check (the figures are already written)."""


@dataclass(frozen=True)
class Setup:
    """Where and how big a step runs, and the folder it may write in (``work``: the check's
    ``OUT``; scratch files go under ``work / "scratch"``)."""

    device: str = "cuda"
    tiny: bool = False
    work: Path = Path(".")

    @property
    def cuda(self) -> bool:
        """True on a CUDA device."""
        return self.device.startswith("cuda")

    @property
    def scratch(self) -> Path:
        """Files that do not outlive the run (saved models); the runner removes it."""
        return self.work / "scratch"


@dataclass(frozen=True)
class _Optional:
    name: str
    deadline: float  # time.monotonic()
    not_measured: Callable[[str], None]


class StepReport:
    """Figures of one step, rewritten to ``path`` (atomically) on every ``put``.

    ``deadline_s``: seconds from now at which the watchdog ends the step (``failed``, exit 1).
    """

    POLL_S = 0.1

    def __init__(self, path: Path, deadline_s: float | None = None) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"status": "running", "figures": {}}
        self._lock = threading.RLock()
        self._started = time.monotonic()
        self.deadline_s = deadline_s
        self._deadline = None if deadline_s is None else self._started + deadline_s
        self._optional: _Optional | None = None
        self._cleanups: list[Callable[[], object]] = []
        self._write()
        if self._deadline is not None:
            threading.Thread(target=self._watch, name="step-deadline", daemon=True).start()

    def put(self, **figures: Any) -> None:
        """Add figures and write the file."""
        with self._lock:
            self.doc["figures"].update(figures)
            self._write()

    def finish(self, status: str, **fields: Any) -> None:
        """Record the outcome (``ok``, ``skipped``, ``failed``) and write the file."""
        with self._lock:
            self.doc.update(status=status, **fields)
            self._write()

    def stage(self, what: str) -> None:
        """Say what the step is doing now (named if its deadline strikes there)."""
        with self._lock:
            self.doc["stage"] = what
            self._write()

    def remaining_s(self) -> float:
        """Seconds left before the step's deadline (``inf`` without one)."""
        if self._deadline is None:
            return float("inf")
        return self._deadline - time.monotonic()

    def on_deadline(self, cleanup: Callable[[], object]) -> None:
        """Run ``cleanup`` (stop a child process, say) before the watchdog ends the process."""
        self._cleanups.append(cleanup)

    @contextmanager
    def optional(
        self, name: str, limit_s: float, not_measured: Callable[[str], None]
    ) -> Iterator[None]:
        """An optional part of the step, given ``limit_s`` (never past the step's deadline).
        If it is still running then, the watchdog calls ``not_measured(why)`` to record it, ends
        the step as passed and exits 0; the part's own errors propagate as usual."""
        limit_s = max(0.0, min(limit_s, self.remaining_s()))
        with self._lock:
            self._optional = _Optional(name, time.monotonic() + limit_s, not_measured)
        if self._deadline is None and limit_s != float("inf"):
            threading.Thread(target=self._watch, name="optional-deadline", daemon=True).start()
        try:
            yield
        finally:
            with self._lock:
                self._optional = None

    def _watch(self) -> None:
        while True:
            time.sleep(self.POLL_S)
            now = time.monotonic()
            with self._lock:
                part = self._optional
                if part is not None and now >= part.deadline:
                    why = f"not measured: {part.name} did not finish within its time"
                    self._end(0, partial(part.not_measured, why), "ok", note=why)
                if self._deadline is not None and now >= self._deadline:
                    stage = self.doc.get("stage", "?")
                    error = f"deadline: the step's own limit of {self.deadline_s:.0f} s was "
                    self._end(1, None, "failed", error=error + f"reached (while: {stage})")
                if part is None and self._deadline is None:
                    return

    def _end(
        self, code: int, record: Callable[[], object] | None, status: str, **fields: Any
    ) -> None:
        """Record, clean up and leave the process now (the main thread may be inside a kernel
        or a compile that nothing else would interrupt)."""
        for step in (record, *self._cleanups):
            try:
                if step is not None:
                    step()
            except Exception as exc:  # the record must still be written
                self.doc.setdefault("cleanup_errors", []).append(f"{type(exc).__name__}: {exc}")
        self.finish(status, **fields)
        print(f"[{self.path.stem}] {fields}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=2, default=str))
        tmp.replace(self.path)
