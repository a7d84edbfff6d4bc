"""``scoring-worker --help`` speaks to users: what the tool does and which command does what,
not the developer note of ``worker/cli.py``'s module docstring."""

from __future__ import annotations

import subprocess
import sys

from worker import cli


def _help(*argv: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "worker", *argv, "--help"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_top_level_help_says_what_the_tool_does() -> None:
    text = " ".join(_help().split())
    assert "Score RL rollouts from a Redis Streams queue" in text
    assert "reference-model log-probs and reward-model scores" in text
    for name, (_, summary) in cli.COMMANDS.items():
        assert name in text and " ".join(summary.split()) in text
    assert "SCORING_*" in text


def test_help_leaves_out_the_developer_note() -> None:
    assert cli.__doc__ is not None and "only place that reads flags/env" in cli.__doc__
    text = " ".join(_help().split())
    assert "only place" not in text and "imported lazily" not in text
    assert "``" not in text  # no reStructuredText markup leaks into the terminal


def test_help_does_not_load_the_subcommands() -> None:
    """``--help`` builds only the root parser: no subcommand module (and never torch) loads."""
    code = (
        "import sys\nfrom worker.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "loaded = [m for m in sys.modules if m.startswith('worker.commands.') or m == 'torch']\n"
        "loaded.remove('worker.commands._help')  # how flags are documented: 50 torch-free lines\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
