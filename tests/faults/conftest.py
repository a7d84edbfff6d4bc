"""Fault-injection harness options and the end-of-session summary table.

``make test-faults`` runs ``pytest tests/faults -m faults --faults-full`` (more jobs, longer fault
schedules); without ``--faults-full`` the quick variant runs inside ``make test``. The summary
(scenario, jobs, lost, duplicated, altered, time) is printed at the end of the session and written
to ``build/faults-summary.json`` (or ``$SCORING_FAULTS_REPORT``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.faults.harness import REPORTS

ROOT = Path(__file__).resolve().parents[2]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--faults-full",
        action="store_true",
        default=False,
        help="run the full fault-injection scenarios (more jobs, longer fault schedules)",
    )


@pytest.fixture(scope="session")
def faults_full(request: pytest.FixtureRequest) -> bool:
    """True under ``--faults-full`` (``make test-faults``)."""
    try:
        return bool(request.config.getoption("--faults-full"))
    except ValueError:  # the option is registered only when tests/faults is a start path
        return False


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not REPORTS:
        return
    cols = ["scenario", "jobs", "lost", "duplicated", "altered", "errors", "unknown", "time_s"]
    widths = {c: max(len(c), *(len(str(r[c])) for r in REPORTS)) for c in cols}
    tr = terminalreporter
    tr.section("fault-injection summary")
    tr.write_line("  ".join(c.ljust(widths[c]) for c in cols))
    for r in REPORTS:
        tr.write_line("  ".join(str(r[c]).ljust(widths[c]) for c in cols))
    for r in REPORTS:
        for f in r.get("faults", []):
            tr.write_line(f"  {r['scenario']}: {f}")
        notes = r.get("notes", {})
        if "jobs_per_s" in notes:
            tr.write_line(
                f"  {r['scenario']}: {notes['jobs_per_s']} jobs/s, p50 {notes['p50_ms']} ms, "
                f"p99 {notes['p99_ms']} ms, redis used_memory {notes['redis_used_memory_bytes']} B "
                f"(peak {notes['redis_peak_used_memory_bytes']} B)"
            )
    path = Path(os.environ.get("SCORING_FAULTS_REPORT", ROOT / "build" / "faults-summary.json"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(REPORTS, indent=2) + "\n")
    tr.write_line(f"written to {path}")
