"""Redis connection factory: standalone or Cluster, TLS and ACL, with retries on errors.

Redis Cluster: every seed node is tried (the URL may list several, comma-separated, and
``RedisSettings.seed_nodes`` adds more), and the *last known topology* before them: each
successful connect (and :func:`remember`, called by whoever holds a live client) records the
nodes a client knew, so a fresh connect after a failover tries the promoted replicas first, not
only a seed that may be the dead primary. :data:`CONNECT_ERRORS` are the errors a caller
retries with backoff while connecting (a cluster with no reachable node raises
``RedisClusterException``, which is not a ``ConnectionError``).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode
from redis.retry import Retry

from worker.config import RedisSettings

RETRY_ERRORS = (redis.ConnectionError, redis.TimeoutError)
#: Errors that mean "Redis (or the cluster's topology) is not reachable right now": retried.
CONNECT_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.RedisClusterException,  # no reachable seed, slots not covered yet
    redis.exceptions.ClusterError,  # CLUSTERDOWN, MASTERDOWN while a replica is promoted
    redis.exceptions.TryAgainError,
    redis.exceptions.ReadOnlyError,  # a demoted primary
)

_known_lock = threading.Lock()
#: seed list -> the nodes (host, port) the last live client of that cluster knew.
_known: dict[tuple[tuple[str, int], ...], list[tuple[str, int]]] = {}
#: each cluster client made here -> its settings (so :func:`remember` needs only the client).
_settings_of: weakref.WeakKeyDictionary[Any, RedisSettings] = weakref.WeakKeyDictionary()


def remember(client: Any) -> list[tuple[str, int]]:
    """Record the nodes ``client`` (a ``RedisCluster`` made by :func:`connect`) knows now as
    the last known topology of its cluster; returns them (empty for a standalone client)."""
    settings = _settings_of.get(client)
    get_nodes = getattr(client, "get_nodes", None)
    if settings is None or get_nodes is None:
        return []
    try:
        nodes = [(str(n.host), int(n.port)) for n in get_nodes()]
    except Exception:  # a client in the middle of a refresh: keep what we had
        return []
    if nodes:
        with _known_lock:
            _known[tuple(settings.cluster_nodes)] = nodes
    return nodes


def startup_nodes(settings: RedisSettings) -> list[tuple[str, int]]:
    """The nodes a new cluster client tries, in order: the last known topology, then the seeds."""
    seeds = settings.cluster_nodes
    with _known_lock:
        known = list(_known.get(tuple(seeds), []))
    return list(dict.fromkeys([*known, *seeds]))


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
        nodes = [ClusterNode(host, port) for host, port in startup_nodes(settings)]
        client = redis.RedisCluster.from_url(settings.plain_url, startup_nodes=nodes, **kwargs)
        _settings_of[client] = settings
        remember(client)
        return client
    return redis.Redis.from_url(settings.plain_url, **kwargs)


def connect_async(settings: RedisSettings) -> Any:
    """An asyncio client for ``settings`` (``redis.asyncio``)."""
    import redis.asyncio as aioredis

    kwargs = _common_kwargs(settings)
    kwargs["retry"] = aioredis.retry.Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=3)
    if settings.is_cluster:
        from redis.asyncio.cluster import ClusterNode as AsyncClusterNode

        kwargs.pop("health_check_interval", None)
        nodes = [AsyncClusterNode(host, port) for host, port in startup_nodes(settings)]
        return aioredis.RedisCluster.from_url(settings.plain_url, startup_nodes=nodes, **kwargs)
    return aioredis.Redis.from_url(settings.plain_url, **kwargs)


_DURABLE_RETRIES = 5
_DURABLE_RETRY_ERRORS: tuple[type[BaseException], ...] = (
    *CONNECT_ERRORS,
    redis.exceptions.MovedError,
)


def node_client(client: Any, key: str) -> Any:
    """The client of the primary that serves ``key`` (``client`` itself when standalone): a
    ``WAIT`` must run on the connection that made the writes it waits for."""
    if not isinstance(client, redis.RedisCluster):
        return client
    node = client.get_node_from_key(key)
    return node.redis_connection or client.get_redis_connection(node)


def xadd_wait(
    client: Any, stream: str, fields: Any, replicas: int, timeout_ms: int
) -> tuple[Any, int]:
    """``XADD stream * fields`` then ``WAIT replicas timeout_ms`` on one connection to the
    stream's primary (``WAIT`` counts the writes of its own connection, so both must share
    one); ``(entry id, replicas that acknowledged)``. On a Cluster a moved slot or a dead
    primary refreshes the topology and tries again (a retry may add a second copy of the
    entry: the job id de-duplicates it)."""
    for attempt in range(_DURABLE_RETRIES):
        try:
            with node_client(client, stream).pipeline(transaction=False) as pipe:
                pipe.xadd(stream, fields)
                pipe.execute_command("WAIT", replicas, timeout_ms)
                entry_id, acked = pipe.execute()
            return entry_id, int(acked)
        except _DURABLE_RETRY_ERRORS:
            if not isinstance(client, redis.RedisCluster) or attempt == _DURABLE_RETRIES - 1:
                raise
            time.sleep(min(0.1 * 2**attempt, 1.0))
            with contextlib.suppress(*CONNECT_ERRORS):
                client.nodes_manager.initialize()
    raise AssertionError("unreachable")  # pragma: no cover


async def xadd_wait_async(
    client: Any, stream: str, fields: Any, replicas: int, timeout_ms: int
) -> tuple[Any, int]:
    """:func:`xadd_wait` for a ``redis.asyncio`` client. On a Cluster both commands go down one
    connection of the stream's primary (``ClusterNode.execute_pipeline``; the cluster
    pipeline would send the keyless ``WAIT`` to any node), with the same retries."""
    import redis.asyncio as aioredis

    if isinstance(client, aioredis.RedisCluster):
        return await _xadd_wait_cluster_async(client, stream, fields, replicas, timeout_ms)
    async with client.pipeline(transaction=False) as pipe:
        pipe.xadd(stream, fields)
        pipe.execute_command("WAIT", replicas, timeout_ms)
        entry_id, acked = await pipe.execute()
    return entry_id, int(acked)


async def _xadd_wait_cluster_async(
    client: Any, stream: str, fields: Any, replicas: int, timeout_ms: int
) -> tuple[Any, int]:
    import asyncio

    from redis.asyncio.cluster import PipelineCommand

    flat = [part for pair in dict(fields).items() for part in pair]
    for attempt in range(_DURABLE_RETRIES):
        try:
            await client.initialize()  # a no-op once the client knows its nodes
            node = client.get_node_from_key(stream)
            xadd = PipelineCommand(0, "XADD", stream, "*", *flat)
            wait = PipelineCommand(1, "WAIT", replicas, timeout_ms)
            await node.execute_pipeline([xadd, wait])
            entry_id: Any = xadd.result
            acked: Any = wait.result
            for reply in (entry_id, acked):
                if isinstance(reply, BaseException):
                    raise reply
            return entry_id, int(acked)
        except _DURABLE_RETRY_ERRORS:
            if attempt == _DURABLE_RETRIES - 1:
                raise
            await asyncio.sleep(min(0.1 * 2**attempt, 1.0))
            with contextlib.suppress(*CONNECT_ERRORS):
                await client.nodes_manager.initialize()
    raise AssertionError("unreachable")  # pragma: no cover


def server_version(client: Any) -> tuple[int, int, int]:
    """The server's (major, minor, patch) from INFO (Valkey reports a compatible redis_version)."""
    info = client.info("server")
    if isinstance(info, dict) and "redis_version" not in info:  # cluster: {node: info}
        info = next(iter(info.values()))
    raw = str(info.get("valkey_version") or info.get("redis_version") or "0.0.0")
    parts = [*raw.split("."), "0", "0"][:3]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)  # type: ignore[return-value]
