"""How a GPU-check step runs and reports: where it runs (``Setup``), its figures file
(``StepReport``, rewritten on every ``put`` so a step stopped at its time limit still leaves what
it had measured), and its two outcomes besides success (``Skip``, ``CheckFailed``).
Standard library only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class Skip(Exception):
    """The step cannot run on this machine (the reason is the message)."""


class CheckFailed(Exception):
    """A measured figure broke its check (the figures are already written)."""


@dataclass(frozen=True)
class Setup:
    """Where and how big a step runs."""

    device: str = "cuda"
    tiny: bool = False

    @property
    def cuda(self) -> bool:
        """True on a CUDA device."""
        return self.device.startswith("cuda")


class StepReport:
    """Figures of one step, rewritten to ``path`` (atomically) on every ``put``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"status": "running", "figures": {}}

    def put(self, **figures: Any) -> None:
        """Add figures and write the file."""
        self.doc["figures"].update(figures)
        self._write()

    def finish(self, status: str, **fields: Any) -> None:
        """Record the outcome (``ok``, ``skipped``, ``failed``) and write the file."""
        self.doc.update(status=status, **fields)
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=2, default=str))
        tmp.replace(self.path)
