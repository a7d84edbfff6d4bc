"""Redis connection factory: standalone or Cluster, TLS and ACL, with retries on errors."""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from worker.config import RedisSettings

RETRY_ERRORS = (redis.ConnectionError, redis.TimeoutError)


def _common_kwargs(settings: RedisSettings) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "socket_timeout": settings.socket_timeout_s,
        "socket_connect_timeout": settings.connect_timeout_s,
        "health_check_interval": settings.health_check_interval_s,
        "retry": Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=3),
        "retry_on_error": list(RETRY_ERRORS),
    }
    if settings.client_name:
        kwargs["client_name"] = settings.client_name
    if settings.plain_url.startswith("rediss://"):
        if settings.ssl_ca_certs:
            kwargs["ssl_ca_certs"] = settings.ssl_ca_certs
        if settings.ssl_certfile:
            kwargs["ssl_certfile"] = settings.ssl_certfile
        if settings.ssl_keyfile:
            kwargs["ssl_keyfile"] = settings.ssl_keyfile
        kwargs["ssl_check_hostname"] = settings.ssl_check_hostname
    return kwargs


def connect(settings: RedisSettings) -> redis.Redis | redis.RedisCluster:
    """A client for ``settings`` (``decode_responses`` off: payloads are bytes)."""
    kwargs = _common_kwargs(settings)
    if settings.is_cluster:
        kwargs.pop("health_check_interval", None)
        return redis.RedisCluster.from_url(settings.plain_url, **kwargs)
    return redis.Redis.from_url(settings.plain_url, **kwargs)


def connect_async(settings: RedisSettings) -> Any:
    """An asyncio client for ``settings`` (``redis.asyncio``)."""
    import redis.asyncio as aioredis

    kwargs = _common_kwargs(settings)
    kwargs["retry"] = aioredis.retry.Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=3)
    if settings.is_cluster:
        kwargs.pop("health_check_interval", None)
        return aioredis.RedisCluster.from_url(settings.plain_url, **kwargs)
    return aioredis.Redis.from_url(settings.plain_url, **kwargs)


def server_version(client: Any) -> tuple[int, int, int]:
    """The server's (major, minor, patch) from INFO (Valkey reports a compatible redis_version)."""
    info = client.info("server")
    if isinstance(info, dict) and "redis_version" not in info:  # cluster: {node: info}
        info = next(iter(info.values()))
    raw = str(info.get("valkey_version") or info.get("redis_version") or "0.0.0")
    parts = [*raw.split("."), "0", "0"][:3]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)  # type: ignore[return-value]
