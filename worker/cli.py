"""The ``scoring-worker`` command line: the only place that reads flags/env and sets up logging.

Subcommands live in ``worker.commands.<name>`` and are imported lazily, so producer-side commands
(``enqueue``, ``info``, ``dlq``, ``check``) never import torch. This docstring is for developers;
what ``--help`` tells users is ``DESCRIPTION``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
from collections.abc import Sequence

from worker import __version__

DESCRIPTION = (
    "Score RL rollouts from a Redis Streams queue: reference-model log-probs and reward-model "
    "scores, one stateless forward pass per batch, on GPU or CPU. Run workers with 'serve'; "
    "submit rollouts and read the scores back with 'enqueue'; inspect and repair the queue with "
    "'info' and 'dlq'; probe a worker with 'check'; try everything on this machine with 'demo' "
    "and measure it with 'bench'; put trainers' HTTP reward and log-prob APIs in front of a "
    "queue with 'gateway'."
)
EPILOG = (
    "'scoring-worker COMMAND --help' lists a command's flags with their defaults; a flag that "
    "has a SCORING_* environment variable names it (every serve flag does; a flag on the "
    "command line wins). Documentation: README.md and docs/ in the source tree (docs/cli.md, "
    "docs/operations-worker.md)."
)

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("worker.commands.serve", "run a worker daemon (one per GPU, or --replicas/--gpus)"),
    "enqueue": ("worker.commands.enqueue", "score a JSONL file of rollouts through the queue"),
    "info": ("worker.commands.info", "show streams, groups, lag, pending, consumers, dead letters"),
    "dlq": ("worker.commands.dlq", "list, replay or purge the dead-letter stream"),
    "check": ("worker.commands.check", "exit 0 when a worker's health endpoint / Redis is fine"),
    "demo": ("worker.commands.demo", "run the whole system on this machine with sample rollouts"),
    "bench": ("worker.commands.bench", "benchmark the executor (and the queue) side by side"),
    "gateway": ("worker.commands.gateway", "serve trainers' reward and log-prob HTTP APIs"),
}


class JsonFormatter(logging.Formatter):
    """One JSON object per log line (``--log-json``)."""

    def format(self, record: logging.LogRecord) -> str:
        obj = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            obj.update(extra)
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str)


def setup_logging(level: str = "INFO", json_logs: bool = False) -> None:
    """Configure the root logger once (stderr)."""
    handler = logging.StreamHandler(sys.stderr)
    if json_logs:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The root parser; only ``command``'s module is imported and configured (all when None)."""
    from worker.commands._help import HelpFormatter
    from worker.config import env_bool, env_get

    parser = argparse.ArgumentParser(
        prog="scoring-worker", description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"scoring-worker {__version__}")
    parser.add_argument(
        "--log-level",
        default=env_get("LOG_LEVEL", "INFO"),
        help="logging level (env SCORING_LOG_LEVEL)",
    )
    parser.add_argument(
        "--log-json",
        action="store_true",
        default=env_bool(env_get("LOG_JSON")),
        help="JSON log lines (env SCORING_LOG_JSON)",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        default=env_bool(env_get("DEBUG")),
        help="show the traceback of an error that stops a command (env SCORING_DEBUG; "
        "--log-level debug does too)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        cmd = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=HelpFormatter
        )
        if command is not None and name != command:
            continue
        mod = importlib.import_module(module)
        mod.configure(cmd)
        if len(cmd._actions) > 20:  # the flags are listed below; a usage line of 50 says little
            cmd.usage = "%(prog)s [options]"
        cmd.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``scoring-worker`` console script."""
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in raw_argv if a in COMMANDS), "")
    parser = build_parser(command)
    args = parser.parse_args(raw_argv)
    setup_logging(args.log_level, args.log_json)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        # Start-up and configuration errors are one or two lines, not a traceback.
        from worker.commands._errors import report

        return report(exc, debug=args.debug or str(args.log_level).upper() == "DEBUG")
