"""Every flag of every command documents itself: help text, its default, and its ``SCORING_*``
variable exactly when it has one (setting the variable changes the flag's default)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from worker import cli

ENV = re.compile(r"SCORING_[A-Z0-9_]+")
SKIP = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)

# A value each flag's environment variable must parse, where the generic guess does not fit.
SENTINELS = {
    "reward_weights": "0.5,0.5",
    "preload": "adapter:probe",
    "gpus": "0,1",
    "cluster_node": "h1:7000,h2:7001",
    "stream": "probe:jobs",
    "log_level": "WARNING",
}


def _parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    root = cli.build_parser()
    yield "scoring-worker", root
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    yield from sub.choices.items()


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, SKIP)]


def _sentinel(action: argparse.Action) -> str:
    if action.dest in SENTINELS:
        return SENTINELS[action.dest]
    if isinstance(action, argparse._StoreTrueAction):
        return "1"
    if isinstance(action, argparse._StoreFalseAction):
        return "0"
    if action.choices:
        return next(str(c) for c in action.choices if c != action.default)
    default = action.default
    if isinstance(default, str) and action.type in (int, float):
        default = action.type(default)  # argparse converts a string default with the type
    if action.type is int or isinstance(default, int):
        return str((default or 0) + 3)
    if action.type is float or isinstance(default, float):
        return str((default or 0.0) + 0.375)
    return "probe-value"


def _defaults(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, object]]:
    with monkeypatch.context() as m:
        for name, value in env.items():
            m.setenv(name, value)
        return {name: {a.dest: a.default for a in _flags(p)} for name, p in _parsers()}


def test_every_flag_has_help() -> None:
    bare = [
        f"{name} {a.option_strings[0]}"
        for name, p in _parsers()
        for a in _flags(p)
        if not (a.help or "").strip()
    ]
    assert not bare, f"flags without help text: {bare}"


def test_defaults_show_in_help() -> None:
    text = cli.build_parser("serve")._subparsers._group_actions[0].choices["serve"].format_help()
    assert "(default: 16384)" in " ".join(text.split())  # --max-batch-tokens
    assert "(default: auto)" in text  # --device


def test_every_flag_names_its_variable_exactly_when_it_reads_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flag that names ``SCORING_X`` changes default when ``SCORING_X`` is set; a flag that
    names none keeps it when ``SCORING_<DEST>`` is set. Every ``serve`` flag names one."""
    for name in [n for n in list(__import__("os").environ) if n.startswith("SCORING_")]:
        monkeypatch.delenv(name)
    base = _defaults({}, monkeypatch)
    problems = []
    for cmd, parser in _parsers():
        for action in _flags(parser):
            named = ENV.findall(action.help or "")
            var = named[0] if named else "SCORING_" + action.dest.upper()
            changed = _defaults({var: _sentinel(action)}, monkeypatch)[cmd][action.dest]
            reads = changed != base[cmd][action.dest]
            flag = f"{cmd} {action.option_strings[0]}"
            if named and not reads:
                problems.append(f"{flag}: help names {var}, but setting it changes nothing")
            if not named and reads:
                problems.append(f"{flag}: reads {var}, but its help does not say so")
            if cmd == "serve" and not named:
                problems.append(f"{flag}: a serve flag without its SCORING_* variable")
    assert not problems, "\n".join(problems)
