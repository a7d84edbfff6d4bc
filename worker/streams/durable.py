"""Durable result writes: ``WAIT`` for replicas on the node that took the results.

``WAIT numreplicas timeout`` blocks until that many replicas acknowledged every write the *same
connection* made, so each helper here sends its writes and the ``WAIT`` in one pipeline on one
connection to one primary (:func:`worker.connections.node_client`).

* :func:`write_then_wait` - the two-step path (reply stream on another Cluster node than its
  job): per reply node, ``XADD`` every result (and ``EXPIRE ... NX``) then ``WAIT``. A result
  whose ``WAIT`` fell short comes back as a :class:`DurableShortfall` error: the caller does
  not ack it (the entry stays held and the write is retried, see docs/guarantees.md);
* :func:`scripts_then_wait` - the one-script path on a Cluster (result ``XADD`` + ``XACK`` in
  one script, :data:`~worker.streams.scripts.RESULT_ACK`): per job node, every script then
  ``WAIT``. The entries are acked already; a shortfall is only reported.

Each ``WAIT`` that returns fewer replicas than asked is recorded in ``shortfalls`` (its path:
``"two_step"`` or ``"one_script"``), which the daemon counts in
``scoring_durable_shortfalls_total``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from worker.connections import CONNECT_ERRORS, node_client
from worker.errors import ConfigError
from worker.protocol import PAYLOAD_FIELD

#: Recorded in ``shortfalls`` for a ``WAIT`` after result writes that are acked afterwards.
TWO_STEP = "two_step"
#: Recorded in ``shortfalls`` for a ``WAIT`` after atomic result + ack scripts.
ONE_SCRIPT = "one_script"


@dataclass(frozen=True)
class Durability:
    """Wait for ``replicas`` replicas (up to ``timeout_ms``) after result writes.

    ``replicas`` 0: off. The two-step path always waits when on (the ack follows a replicated
    result only); ``after_scripts`` also waits after the atomic one-script write + ack.
    """

    replicas: int = 0
    timeout_ms: int = 1000
    after_scripts: bool = False

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ConfigError(f"durable_replicas must be >= 0, got {self.replicas}")
        if self.timeout_ms <= 0:  # WAIT n 0 would block forever
            raise ConfigError(f"durable_timeout_ms must be > 0, got {self.timeout_ms}")

    @property
    def enabled(self) -> bool:
        """Whether any write waits."""
        return self.replicas > 0


class DurableShortfall(redis.ResponseError):
    """Fewer replicas than asked acknowledged a result in time (the text starts with the
    ``NOREPLICAS`` code, so :func:`~worker.streams.is_transient` retries it)."""


def _short(reply: Any, replicas: int) -> bool:
    return isinstance(reply, Exception) or int(reply) < replicas


def _by_node(client: Any, items: Sequence[Any], key_of: Callable[[Any], str]) -> list[list[Any]]:
    """``items`` grouped by the primary that serves ``key_of(item)`` (one group standalone)."""
    if not isinstance(client, redis.RedisCluster):
        return [list(items)]
    groups: dict[str, list[Any]] = {}
    for item in items:
        groups.setdefault(client.get_node_from_key(key_of(item)).name, []).append(item)
    return list(groups.values())


def _pipeline_on_node(client: Any, key: str, fill: Callable[[Any], None]) -> list[Any]:
    """Run ``fill(pipe)`` on one pipeline to the primary of ``key``; on a connection error or a
    moved slot (a failover), refresh the cluster's topology before raising."""
    try:
        with node_client(client, key).pipeline(transaction=False) as pipe:
            fill(pipe)
            replies: list[Any] = pipe.execute(raise_on_error=False)
    except CONNECT_ERRORS:
        _refresh(client)
        raise
    if any(isinstance(r, redis.exceptions.MovedError) for r in replies):
        _refresh(client)
    return replies


def _refresh(client: Any) -> None:
    if isinstance(client, redis.RedisCluster):
        with contextlib.suppress(*CONNECT_ERRORS):
            client.nodes_manager.initialize()


def write_then_wait(
    client: Any,
    deliveries: Sequence[Any],
    *,
    maxlen: int,
    reply_ttl_s: int,
    durability: Durability,
    shortfalls: list[str],
) -> list[Any]:
    """``XADD`` each delivery's result to its ``reply_to`` then ``WAIT`` on that node; per
    delivery (in order) the entry id, or the error: its own, or a :class:`DurableShortfall`."""
    out: dict[int, Any] = {}
    indexed = list(enumerate(deliveries))
    for group in _by_node(client, indexed, lambda item: str(item[1].reply_to)):

        def fill(pipe: Any, group: list[tuple[int, Any]] = group) -> None:
            for _, d in group:
                pipe.xadd(d.reply_to, {PAYLOAD_FIELD: d.payload}, maxlen=maxlen, approximate=True)
                if reply_ttl_s > 0:
                    pipe.expire(d.reply_to, reply_ttl_s, nx=True)  # an error on Redis < 7
            pipe.execute_command("WAIT", durability.replicas, durability.timeout_ms)

        replies = _pipeline_on_node(client, str(group[0][1].reply_to), fill)
        waited = replies[-1]
        step = 2 if reply_ttl_s > 0 else 1
        short = _short(waited, durability.replicas)
        if short:
            shortfalls.append(TWO_STEP)
        for n, (i, _) in enumerate(group):
            reply = replies[n * step]
            if not isinstance(reply, Exception) and short:
                got = "an error" if isinstance(waited, Exception) else f"{int(waited)} replicas"
                reply = DurableShortfall(
                    f"NOREPLICAS result written but {got} acknowledged it within "
                    f"{durability.timeout_ms} ms ({durability.replicas} wanted)"
                )
            out[i] = reply
    return [out[i] for i in range(len(deliveries))]


def scripts_then_wait(
    client: Any,
    deliveries: Sequence[Any],
    script_args: Callable[[Any], tuple[Any, ...]],
    *,
    durability: Durability,
    shortfalls: list[str],
) -> list[Any]:
    """Run each delivery's result + ack script (``script_args(d)`` for ``EVAL``) then ``WAIT``
    on the job stream's node; per delivery (in order) the script's reply or its error."""
    out: dict[int, Any] = {}
    indexed = list(enumerate(deliveries))
    for group in _by_node(client, indexed, lambda item: str(item[1].stream)):

        def fill(pipe: Any, group: list[tuple[int, Any]] = group) -> None:
            for _, d in group:
                pipe.eval(*script_args(d))
            pipe.execute_command("WAIT", durability.replicas, durability.timeout_ms)

        replies = _pipeline_on_node(client, str(group[0][1].stream), fill)
        if _short(replies[-1], durability.replicas):
            shortfalls.append(ONE_SCRIPT)
        for n, (i, _) in enumerate(group):
            out[i] = replies[n]
    return [out[i] for i in range(len(deliveries))]


__all__ = [
    "ONE_SCRIPT",
    "TWO_STEP",
    "Durability",
    "DurableShortfall",
    "scripts_then_wait",
    "write_then_wait",
]
