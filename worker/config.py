"""Configuration as data: frozen dataclasses built once (by ``cli``) and passed down.

Units are in field names. ``from_env`` helpers are the only place that reads ``SCORING_*``
environment variables; nothing reads the environment at import time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from worker.errors import ConfigError
from worker.protocol import Limits

ENV_PREFIX = "SCORING_"
#: The Redis every command, the client and the worker use when given no URL.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


@dataclass(frozen=True)
class RedisSettings:
    """How to reach Redis (standalone or Cluster, plain or TLS, password or ACL user)."""

    url: str = DEFAULT_REDIS_URL
    cluster: bool = False
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_check_hostname: bool = True
    socket_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    health_check_interval_s: float = 15.0
    client_name: str | None = None

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
            raise ConfigError(
                f"redis url must start with redis://, rediss://, unix://, redis+cluster:// or "
                f"rediss+cluster://, got {redact_url(self.url)!r}"
            )
        if self.socket_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ConfigError("redis timeouts must be > 0")

    @property
    def is_cluster(self) -> bool:
        """True for ``--cluster`` or a ``redis+cluster://``/``rediss+cluster://`` URL."""
        return self.cluster or urlsplit(self.url).scheme.endswith("+cluster")

    @property
    def plain_url(self) -> str:
        """The URL redis-py understands (``+cluster`` removed)."""
        parts = urlsplit(self.url)
        return urlunsplit(parts._replace(scheme=parts.scheme.replace("+cluster", "")))

    @property
    def redacted_url(self) -> str:
        """The URL with any password replaced by ``***`` (safe to log)."""
        return redact_url(self.url)


def redact_url(url: str) -> str:
    """Replace the password of a URL with ``***`` so it can be logged."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def env_get(
    name: str, default: str | None = None, env: Mapping[str, str] | None = None
) -> str | None:
    """Read ``SCORING_<NAME>`` from ``env`` (default ``os.environ``)."""
    source = os.environ if env is None else env
    return source.get(ENV_PREFIX + name.upper().replace("-", "_"), default)


def env_bool(value: str | None, default: bool = False) -> bool:
    """Parse a boolean environment value (1/true/yes/on)."""
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker daemon consumes its streams (built by ``serve`` from flags/env).

    ``streams`` are the job stream keys (one per partition); ``dead_letter_stream`` None means
    each stream's own ``...:dead`` stream (``worker.keys.dead_letter_stream``).
    """

    streams: tuple[str, ...]
    group: str = "scoring"
    consumer: str = "worker"
    max_batch_tokens: int = 16384
    max_wait_ms: int = 5
    block_ms: int = 1000
    read_count: int = 64
    claim_idle_ms: int = 30000
    reclaim_interval_ms: int | None = None  # default: claim_idle_ms / 2
    max_deliveries: int = 5
    # an entry delivered more often than this runs in a batch of its own (poison isolation)
    isolate_after_deliveries: int = 2
    # delete this consumer from its groups on a clean stop when it holds nothing
    forget_consumer: bool = True
    dead_letter_stream: str | None = None
    drain_timeout_s: float = 60.0
    batch_timeout_s: float = 1800.0  # /healthz fails once one batch computes longer than this
    result_maxlen: int = 10000
    reply_ttl_s: int = 3600  # a reply stream without a TTL gets this one (0: none)
    dead_letter_maxlen: int = 100000
    stats_interval_s: float = 5.0
    burst: bool = False
    max_jobs: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 9400  # None: no HTTP endpoint; 0: a free port
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if not self.streams:
            raise ConfigError("a worker needs at least one stream")
        if not self.group or not self.consumer:
            raise ConfigError("group and consumer must be non-empty")
        for name in (
            "max_batch_tokens",
            "read_count",
            "claim_idle_ms",
            "max_deliveries",
            "isolate_after_deliveries",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_wait_ms", "block_ms", "result_maxlen", "dead_letter_maxlen",
                     "reply_ttl_s"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.drain_timeout_s <= 0 or self.batch_timeout_s <= 0:
            raise ConfigError("drain_timeout_s and batch_timeout_s must be > 0")
        if self.max_jobs is not None and self.max_jobs <= 0:
            raise ConfigError(f"max_jobs must be > 0, got {self.max_jobs}")

    @property
    def lease_interval_s(self) -> float:
        """How often in-flight entries are renewed: a third of the idle limit."""
        return max(self.claim_idle_ms / 3000.0, 0.05)

    @property
    def reclaim_every_s(self) -> float:
        """How often idle entries of dead consumers are looked for."""
        ms = self.reclaim_interval_ms if self.reclaim_interval_ms else self.claim_idle_ms / 2
        return max(ms / 1000.0, 0.05)
