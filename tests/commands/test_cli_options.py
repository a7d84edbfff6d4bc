"""The Redis/TLS and queue flags have one definition (``worker.commands._options``): every command
that talks to Redis, ``serve`` included, takes the same flags and ``SCORING_*`` variables and
builds its ``RedisSettings`` the same way (no Redis needed)."""

from __future__ import annotations

import pytest

from worker.cli import build_parser
from worker.commands._options import redis_settings
from worker.config import DEFAULT_REDIS_URL, RedisSettings
from worker.modes import MODES

# command -> the argv its parser needs besides the Redis flags
COMMANDS: dict[str, list[str]] = {
    "serve": ["serve"],
    "enqueue": ["enqueue", "--file", "in.jsonl", "--out", "out.jsonl"],
    "info": ["info"],
    "dlq": ["dlq", "list"],
    "check": ["check"],
    "demo": ["demo"],
}
TLS_ENV = ("SCORING_SSL_CA_CERTS", "SCORING_SSL_CERTFILE", "SCORING_SSL_KEYFILE")


def _settings(command: str, *flags: str) -> RedisSettings:
    argv = COMMANDS[command]
    return redis_settings(build_parser(command).parse_args([*argv, *flags]))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SCORING_REDIS_URL", "SCORING_CLUSTER", "SCORING_SSL_NO_CHECK_HOSTNAME", *TLS_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_takes_the_tls_flags(command: str) -> None:
    s = _settings(
        command,
        "--redis-url", "rediss://redis.example:6380/0", "--ssl-ca-certs", "/ca.pem",
        "--ssl-certfile", "/c.pem", "--ssl-keyfile", "/k.pem", "--ssl-no-check-hostname",
        "--cluster",
    )  # fmt: skip
    assert (s.url, s.ssl_ca_certs, s.ssl_certfile, s.ssl_keyfile) == (
        "rediss://redis.example:6380/0",
        "/ca.pem",
        "/c.pem",
        "/k.pem",
    )
    assert s.ssl_check_hostname is False and s.is_cluster


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_reads_the_same_environment(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SCORING_REDIS_URL", "rediss://env.example:6380/1")
    monkeypatch.setenv("SCORING_SSL_NO_CHECK_HOSTNAME", "true")
    for name in TLS_ENV:
        monkeypatch.setenv(name, f"/{name.lower()}")
    s = _settings(command)
    assert s.url == "rediss://env.example:6380/1" and s.ssl_check_hostname is False
    assert s.ssl_ca_certs == "/scoring_ssl_ca_certs" and s.ssl_keyfile == "/scoring_ssl_keyfile"
    # a flag on the command line wins over the environment
    assert _settings(command, "--redis-url", "redis://flag:1/0").url == "redis://flag:1/0"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_default_url_and_hostname_check(command: str) -> None:
    s = _settings(command)
    assert s.url == DEFAULT_REDIS_URL and s.ssl_check_hostname is True and not s.is_cluster


def test_serve_keeps_its_queue_flags_beside_the_shared_ones() -> None:
    args = build_parser("serve").parse_args(
        ["serve", "--queue", "q", "--partitions", "2", "--group", "g", "--stream", "a:{x}:jobs"]
    )
    # serve's --queue is repeatable (NAME[:WEIGHT] each): a list, here of one
    assert (args.queue, args.partitions, args.group, args.stream) == (["q"], 2, "g", "a:{x}:jobs")


def test_enqueue_modes_are_the_protocol_modes() -> None:
    parser = build_parser("enqueue")
    for mode in MODES:
        args = parser.parse_args([*COMMANDS["enqueue"], "--mode", mode])
        assert args.mode == mode
    with pytest.raises(SystemExit):
        parser.parse_args([*COMMANDS["enqueue"], "--mode", "generate"])
