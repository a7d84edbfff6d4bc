"""How ``--help`` documents a flag: its text, its default, and its ``SCORING_*`` variable.

``HelpFormatter`` adds ``(default: X)`` to a flag whose help does not already speak of its
default (booleans and flags without a default say what they do instead). ``name_env_vars``
appends ``[env SCORING_<FLAG>]`` to each flag of a parser whose every flag reads one (``serve``,
``gateway``) and whose help does not already name it. ``tests/commands/test_cli_flags.py`` walks
every parser: no flag without help, and a flag names a variable exactly when setting it changes
the flag's default.
"""

from __future__ import annotations

import argparse

ENV_PREFIX = "SCORING_"


def _documented_default(action: argparse.Action) -> bool:
    if action.default in (None, argparse.SUPPRESS, [], (), ""):
        return False
    if isinstance(action.default, bool) or action.nargs == 0:
        return False
    return "default" not in (action.help or "").lower()


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's formatter, plus each flag's default where its help does not give it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and _documented_default(action):
            text += " (default: %(default)s)"
        return text


def env_name(action: argparse.Action) -> str:
    """The ``SCORING_*`` variable of a flag by the convention: its destination, upper case."""
    return ENV_PREFIX + action.dest.upper()


def name_env_vars(parser: argparse.ArgumentParser) -> None:
    """Append ``[env SCORING_<DEST>]`` to every flag of ``parser`` whose help names no variable
    (for a command whose every flag reads its variable by the convention)."""
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        if ENV_PREFIX not in (action.help or ""):
            action.help = f"{action.help or ''} [env {env_name(action)}]".strip()


__all__ = ["ENV_PREFIX", "HelpFormatter", "env_name", "name_env_vars"]
