"""Configuration as data: frozen dataclasses built once (by ``cli``) and passed down.

The shared part lives here: how to reach Redis (:class:`RedisSettings`, used by the client, the
streams commands and the daemon), the default URL and the ``SCORING_*`` environment helpers. A
layer's own configuration lives with it (the daemon's ``WorkerConfig`` in
``worker.daemon.config``). Units are in field names. :func:`env_get` is the one reader of
``SCORING_*`` variables; nothing reads the environment at import time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from worker.errors import ConfigError

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
    #: More Cluster seed nodes (``host:port``) besides the URL's (which may list several,
    #: comma-separated: ``redis+cluster://h1:7000,h2:7000``); tried after the last known topology.
    seed_nodes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
            raise ConfigError(
                f"redis url must start with redis://, rediss://, unix://, redis+cluster:// or "
                f"rediss+cluster://, got {redact_url(self.url)!r}"
            )
        if self.socket_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ConfigError("redis timeouts must be > 0")
        nodes = self.cluster_nodes
        if len(nodes) > 1 and not self.is_cluster:
            raise ConfigError("several seed nodes need Redis Cluster (redis+cluster://)")

    @property
    def cluster_nodes(self) -> list[tuple[str, int]]:
        """Every seed node (``(host, port)``): the URL's hosts, then ``seed_nodes``."""
        parts = urlsplit(self.url)
        if parts.scheme == "unix":
            return []
        hosts = [h for h in parts.netloc.rpartition("@")[2].split(",") if h]
        out = []
        for spec in [*hosts, *self.seed_nodes]:
            host, sep, port = spec.strip().rpartition(":")
            if not sep:
                host, port = port, "6379"
            if not port.isdigit():
                raise ConfigError(f"a seed node must be host:port, got {spec!r}")
            out.append((host.strip("[]"), int(port)))
        return out

    @property
    def is_cluster(self) -> bool:
        """True for ``--cluster`` or a ``redis+cluster://``/``rediss+cluster://`` URL."""
        return self.cluster or urlsplit(self.url).scheme.endswith("+cluster")

    @property
    def plain_url(self) -> str:
        """The URL redis-py understands (``+cluster`` removed, only the first seed host)."""
        parts = urlsplit(self.url)
        userinfo, at, hosts = parts.netloc.rpartition("@")
        netloc = f"{userinfo}{at}{hosts.split(',')[0]}"
        return urlunsplit(
            parts._replace(scheme=parts.scheme.replace("+cluster", ""), netloc=netloc)
        )

    @property
    def redacted_url(self) -> str:
        """The URL with any password replaced by ``***`` (safe to log)."""
        return redact_url(self.url)


def redact_url(url: str) -> str:
    """Replace the password of a URL with ``***`` so it can be logged."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hosts}"))


def env_get(
    name: str, default: str | None = None, env: Mapping[str, str] | None = None
) -> str | None:
    """Read ``SCORING_<NAME>`` from ``env`` (default ``os.environ``)."""
    source = os.environ if env is None else env
    return source.get(ENV_PREFIX + name.upper().replace("-", "_"), default)


def env_float(name: str, default: float, env: Mapping[str, str] | None = None) -> float:
    """``SCORING_<NAME>`` as a float; ``default`` when it is unset or empty."""
    raw = env_get(name, env=env)
    return float(raw) if raw else default


def env_bool(value: str | None, default: bool = False) -> bool:
    """Parse a boolean environment value (1/true/yes/on)."""
    if value is None:
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")
