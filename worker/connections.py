"""Redis connection factory: standalone or Cluster, TLS and ACL, with retries on errors.

Redis Cluster: every seed node is tried (the URL may list several, comma-separated, and
``RedisSettings.seed_nodes`` adds more), and the *last known topology* before them: each
successful connect (and :func:`remember`, called by whoever holds a live client) records the
nodes a client knew, so a fresh connect after a failover tries the promoted replicas first, not
only a seed that may be the dead primary. :data:`CONNECT_ERRORS` are the errors a caller
retries with backoff while connecting (a cluster with no reachable node raises
``RedisClusterException``, which is not a ``ConnectionError``).

What the server keeps (docs/operations.md): :func:`server_states` reads each primary's
``maxmemory-policy``, persistence and memory (``CONFIG GET`` where allowed, else ``INFO memory``
and ``INFO persistence``); :func:`check_server` is the start-up check of workers and gateways (a
policy other than ``noeviction`` is refused unless allowed, no persistence is a warning), and
:class:`ServerWatch` reads them again every minute and logs a policy changed at run time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode
from redis.retry import Retry

from worker.config import RedisSettings
from worker.errors import ConfigError

log = logging.getLogger(__name__)

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


# -- what the server keeps: eviction policy, persistence, memory (docs/operations.md)

#: The one ``maxmemory-policy`` under which Redis never deletes a key to make room.
SAFE_POLICY = "noeviction"


@dataclass(frozen=True)
class ServerState:
    """What one primary says about keeping what it is given (None: it would not say)."""

    node: str  # "host:port"
    policy: str | None  # maxmemory-policy
    aof: bool | None  # appendonly
    rdb: bool | None  # a save schedule (CONFIG GET save; INFO cannot say)
    used_memory_bytes: int | None
    maxmemory_bytes: int | None  # 0: no limit
    via: str  # "config" (CONFIG GET), "info" (CONFIG refused: INFO only), "none" (both refused)
    system_memory_bytes: int | None = None  # the host's (INFO total_system_memory)

    @property
    def evicts(self) -> bool:
        """Whether the policy deletes keys under memory pressure."""
        return self.policy is not None and self.policy != SAFE_POLICY

    @property
    def persistent(self) -> bool | None:
        """True with AOF or RDB on, False with both off, None when it cannot be told."""
        if self.aof or self.rdb:
            return True
        return False if self.aof is False and self.rdb is False else None

    @property
    def memory_limit(self) -> str | None:
        """What the memory is counted against: ``maxmemory``, else ``system`` (no limit set:
        the host's memory is the limit), None when neither is known."""
        if self.maxmemory_bytes:
            return "maxmemory"
        return "system" if self.system_memory_bytes else None

    @property
    def memory_used_ratio(self) -> float | None:
        """``used_memory`` over :attr:`memory_limit`'s bytes (None when unknown)."""
        limit = self.maxmemory_bytes or self.system_memory_bytes
        if not limit or self.used_memory_bytes is None:
            return None
        return self.used_memory_bytes / limit

    def to_json(self) -> dict[str, Any]:
        """The fields and the derived ``evicts``, ``persistent``, ``memory_used_ratio``."""
        out = dict(self.__dict__)
        out.update(evicts=self.evicts, persistent=self.persistent)
        out.update(memory_limit=self.memory_limit, memory_used_ratio=self.memory_used_ratio)
        return out


def _primaries(client: Any) -> list[tuple[str, Any]]:
    """``(host:port, client of that node)`` of every primary (the client itself standalone)."""
    if isinstance(client, redis.RedisCluster):
        out = []
        for node in client.get_primaries():
            conn = node.redis_connection or client.get_redis_connection(node)
            out.append((f"{node.host}:{node.port}", conn))
        return out
    kw = client.connection_pool.connection_kwargs
    return [(f"{kw.get('host', kw.get('path', '?'))}:{kw.get('port', '')}".rstrip(":"), client)]


def _config(conn: Any) -> dict[str, Any] | None:
    """``CONFIG GET`` of the policy, ``save`` and ``appendonly``; None where it is refused (an
    ACL without it, a managed service, CONFIG renamed away)."""
    try:
        config = dict(conn.config_get("maxmemory-policy"))
        for name in ("save", "appendonly"):
            config.update(conn.config_get(name))
    except redis.ResponseError:
        return None
    return config


def _read_state(node: str, conn: Any, use_config: bool) -> ServerState:
    mem = conn.info("memory")
    persistence = conn.info("persistence")
    policy = mem.get("maxmemory_policy")
    aof = bool(int(persistence["aof_enabled"])) if "aof_enabled" in persistence else None
    rdb: bool | None = None  # INFO cannot say whether a save schedule is set
    config = _config(conn) if use_config else None
    if config is not None:
        policy = config.get("maxmemory-policy", policy)
        rdb = bool(str(config.get("save", "")).strip()) if "save" in config else None
        if "appendonly" in config:
            aof = str(config["appendonly"]).lower() == "yes"
    via = "info" if config is None else "config"
    used, limit, host = (mem.get(k) for k in ("used_memory", "maxmemory", "total_system_memory"))
    return ServerState(
        node, None if policy is None else str(policy), aof, rdb,
        None if used is None else int(used), None if limit is None else int(limit), via,
        None if host is None else int(host),
    )  # fmt: skip


def server_states(client: Any, *, use_config: bool = True) -> list[ServerState]:
    """Each primary's eviction policy, persistence and memory: ``CONFIG GET maxmemory-policy``,
    ``save`` and ``appendonly`` where allowed (``use_config``), ``INFO memory`` and ``INFO
    persistence`` otherwise (managed servers often refuse ``CONFIG``). A node that refuses
    ``INFO`` too reports nothing (every field None)."""
    states = []
    for node, conn in _primaries(client):
        try:
            states.append(_read_state(node, conn, use_config))
        except redis.ResponseError:
            states.append(ServerState(node, None, None, None, None, None, "none"))
    return states


def _losses(policy: str) -> str:
    if policy.startswith("volatile"):
        return "keys with a TTL (reply streams: results the producers wait for; worker heartbeats)"
    return "any key (job streams with their pending entries, reply and dead-letter streams)"


def eviction_problem(states: list[ServerState]) -> str | None:
    """The one line that says a primary evicts (its policy, what it loses, the two ways out);
    None when every readable policy is ``noeviction``."""
    evicting = [s for s in states if s.evicts]
    if not evicting:
        return None
    policy = str(evicting[0].policy)
    nodes = ", ".join(s.node for s in evicting)
    return (
        f"Redis maxmemory-policy is {policy} on {nodes}: under memory pressure it deletes "
        f"{_losses(policy)}, and those jobs are lost without an error; set maxmemory-policy "
        f"{SAFE_POLICY} (CONFIG SET, redis.conf or the managed service's parameters), or run "
        "anyway with --allow-redis-eviction"
    )


def persistence_problem(states: list[ServerState]) -> str | None:
    """The warning for primaries with neither AOF nor RDB (a restart empties every queue)."""
    off = [s.node for s in states if s.persistent is False]
    if not off:
        return None
    return (
        f"Redis persistence is off on {', '.join(off)} (appendonly no, no save schedule): a "
        "restart of Redis empties every queue; set appendonly yes (docs/operations.md)"
    )


def check_server(client: Any, *, allow_eviction: bool) -> list[ServerState]:
    """The start-up check of a worker or gateway: ``ConfigError`` (its message the one line of
    :func:`eviction_problem`) when a primary evicts and ``allow_eviction`` is off; logged when
    allowed, as is missing persistence (a warning, never a refusal). The states read."""
    states = server_states(client)
    problem = eviction_problem(states)
    if problem and not allow_eviction:
        raise ConfigError(problem)
    if problem:
        log.warning("%s (serving anyway: --allow-redis-eviction)", problem)
    for state in states:
        if state.policy is None:
            log.warning("cannot read the maxmemory-policy of %s (INFO refused)", state.node)
    warning = persistence_problem(states)
    if warning:
        log.warning("%s", warning)
    return states


class ServerWatch:
    """Reads :func:`server_states` again every ``interval_s`` (:meth:`poll`, when due) and logs
    a policy that changed since the last read; ``states`` holds the last read. Once a read
    found ``CONFIG GET`` refused it asks ``INFO`` only, and once ``INFO`` is refused too it asks
    nothing more (one ACL denial each, not one a minute)."""

    def __init__(self, interval_s: float = 60.0, states: list[ServerState] | None = None) -> None:
        self.interval_s = interval_s
        self.states: list[ServerState] = list(states or [])
        self.use_config = all(s.via == "config" for s in self.states)
        self._next = time.monotonic() + interval_s if states is not None else 0.0

    @property
    def evicting(self) -> bool:
        """Whether a primary evicted at the last read."""
        return any(s.evicts for s in self.states)

    def poll(self, client: Any, now: float | None = None) -> list[ServerState] | None:
        """The states, read again when due (None when not due); errors propagate."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return None
        self._next = now + self.interval_s
        return self.read(client)

    def read(self, client: Any) -> list[ServerState]:
        """The states now (a policy changed since the last read is logged as an error)."""
        if self.states and all(s.via == "none" for s in self.states):
            return self.states  # INFO refused: the server cannot say, and will not
        before = {s.node: s.policy for s in self.states}
        states = server_states(client, use_config=self.use_config)
        self.use_config = all(s.via == "config" for s in states)
        for state in states:
            old = before.get(state.node, state.policy)
            if state.policy != old:
                log.error(
                    "Redis maxmemory-policy of %s changed from %s to %s while serving%s",
                    state.node, old, state.policy,
                    ": " + (eviction_problem([state]) or "") if state.evicts else "",
                )  # fmt: skip
        self.states = states
        return states


def server_summary(states: list[ServerState], *, allowed: bool) -> dict[str, Any]:
    """What health and ``info`` show: ``evicting`` (a primary evicts), ``eviction_allowed``,
    ``persistent`` (False: a primary has neither AOF nor RDB) and each primary's state."""
    return {
        "evicting": any(s.evicts for s in states),
        "eviction_allowed": allowed,
        "persistent": all(s.persistent is not False for s in states),
        "primaries": [s.to_json() for s in states],
    }
