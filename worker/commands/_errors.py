"""What a command prints when it cannot start: one or two lines on stderr, never a traceback.

``report(exc, debug=...)`` turns an exception that escaped a command's ``run`` into
``error: <what>`` plus, where we know it, a line that says what to do, and returns the exit
code: 2 for configuration and usage (a bad flag value, a missing model path, a port in use,
Redis refusing the credentials or not answering at start), 1 for anything unexpected. With
``--debug`` (or ``--log-level debug`` / ``SCORING_LOG_LEVEL=debug``) the traceback is logged
too; without it the last line says how to get it.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from worker.errors import ConfigError, ScoringError

log = logging.getLogger("worker.cli")

CONFIG_EXIT = 2
"""Exit code of a usage or configuration error (argparse's own usage errors use 2 too)."""

UNEXPECTED_EXIT = 1

REDIS_URL_HINT = "set --redis-url (env SCORING_REDIS_URL), e.g. redis://127.0.0.1:6379/0"


def describe(exc: BaseException) -> tuple[str, str | None, int]:
    """``(message, what to do or None, exit code)`` for ``exc``."""
    import redis.exceptions as rexc  # a base dependency; imported only on this path

    if isinstance(exc, ConfigError):
        return str(exc), exc.hint, CONFIG_EXIT
    if isinstance(exc, (rexc.NoPermissionError, rexc.AuthenticationError)):
        return (
            f"redis refused the command: {exc}",
            "check the user and password in --redis-url and the ACL rules (docs/security.md)",
            CONFIG_EXIT,
        )
    if isinstance(exc, (rexc.ConnectionError, rexc.TimeoutError)):
        return f"cannot reach Redis: {exc}", f"is the server running? {REDIS_URL_HINT}", CONFIG_EXIT
    if isinstance(exc, ScoringError):
        return f"{exc} [{exc.code}]", None, UNEXPECTED_EXIT
    return f"unexpected {type(exc).__name__}: {exc}", None, UNEXPECTED_EXIT


def report(exc: BaseException, *, debug: bool, stream: TextIO | None = None) -> int:
    """Print ``exc`` for a user (see the module docstring); the exit code."""
    out = stream or sys.stderr
    message, hint, code = describe(exc)
    if debug:
        log.error("traceback of the error below", exc_info=exc)
    print(f"error: {message}", file=out)
    if hint:
        print(f"  {hint}", file=out)
    if not debug and code == UNEXPECTED_EXIT:
        print("  (run with --debug, or SCORING_LOG_LEVEL=debug, for the traceback)", file=out)
    return code


__all__ = ["CONFIG_EXIT", "REDIS_URL_HINT", "describe", "report"]
