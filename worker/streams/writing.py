"""Writing results, acking and dead-lettering: the only place a job entry leaves the PEL.

* :func:`write_results` - result ``XADD`` + ``XACK``, atomic (script
  :data:`~worker.streams.scripts.RESULT_ACK`, one per job) when the reply stream shares the job
  stream's slot, else ``XADD`` then ``XACK``; never ack before the result is written (with
  a :class:`~worker.streams.durable.Durability`, never before a replica has it: ``WAIT``);
* :func:`ack` - ``XACK``, one command per stream;
* :func:`dead_letter` - dead-letter ``XADD`` + the producer's error result + ``XACK`` in one
  script (:data:`~worker.streams.scripts.DEAD_ACK`) where the keys share a slot.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from worker.keys import same_slot
from worker.protocol import PAYLOAD_FIELD
from worker.streams.durable import ONE_SCRIPT, Durability, scripts_then_wait, write_then_wait
from worker.streams.groups import is_cluster
from worker.streams.reading import Entry, as_text
from worker.streams.scripts import DEAD_ACK, RESULT_ACK
from worker.streams.transient import TransientRedisError, error_text, is_transient


@dataclass
class Delivery:
    """One result to write for one job entry (``reply_to`` None: nothing to write, ack only)."""

    stream: str
    entry_id: str
    reply_to: str | None
    payload: bytes | None


def write_results(
    client: Any,
    group: str,
    deliveries: Sequence[Delivery],
    *,
    maxlen: int,
    consumer: str = "",
    superseded: list[Delivery] | None = None,
    reply_ttl_s: int = 0,
    durability: Durability | None = None,
    shortfalls: list[str] | None = None,
) -> list[tuple[Delivery, str]]:
    """Write every result and ack its entry; returns ``(delivery, error)`` for those that failed.

    With ``consumer`` set, the atomic script first checks who holds the entry: when another
    consumer has taken it over (this worker was paused past the claim idle time), nothing is
    written, since the new holder answers it; such deliveries go to ``superseded``. An entry
    that is no longer pending at all is still answered (at-least-once wins over de-duplication).

    A result whose reply stream shares the job stream's slot goes in with its ack in one atomic
    script call; otherwise the result ``XADD`` completes before the ``XACK`` is sent. All calls of
    one batch share one pipeline (one round trip). A failed write leaves its entry pending; the
    error text keeps its Redis code (``OOM ...``), see :func:`~worker.streams.is_transient`.

    ``reply_ttl_s`` > 0 gives a reply stream that has no TTL one, so a result that arrives after
    its client closed (a duplicate, a DLQ replay) does not leave a key behind forever; a TTL the
    client keeps refreshing is left alone. (On the non-atomic cross-slot path the TTL is set
    with ``EXPIRE`` after the write, on servers that have ``EXPIRE ... NX``: Redis >= 7.)

    ``durability`` (replicas > 0): on the two-step path each reply node's writes are followed
    by ``WAIT replicas timeout_ms`` on the same connection, and only results a replica
    acknowledged are acked; the others fail with a ``NOREPLICAS ...`` error (transient: the
    caller keeps the entry held and writes again). With ``after_scripts`` the atomic scripts
    are followed by a ``WAIT`` too (their entries are acked either way). Every ``WAIT`` that
    fell short is appended to ``shortfalls`` (``"two_step"`` or ``"one_script"``).
    """
    failures: list[tuple[Delivery, str]] = []
    if not deliveries:
        return failures
    atomic: list[Delivery] = []
    split: list[Delivery] = []
    ack_only: list[Delivery] = []
    cluster = is_cluster(client)
    for d in deliveries:
        if d.reply_to is None or d.payload is None:
            ack_only.append(d)
        elif not cluster or same_slot(d.reply_to, d.stream):
            atomic.append(d)
        else:
            split.append(d)

    def script_args(d: Delivery) -> tuple[Any, ...]:
        return (RESULT_ACK, 2, d.reply_to, d.stream, group, d.entry_id, d.payload, maxlen,
                consumer, reply_ttl_s)  # fmt: skip

    dur = durability if durability is not None else Durability()
    durable = dur.enabled
    shorts = shortfalls if shortfalls is not None else []
    wait_scripts = durable and dur.after_scripts and bool(atomic)
    pipe = client.pipeline(transaction=False)
    atomic_replies: list[Any] = []
    if cluster and wait_scripts:  # scripts + WAIT on one connection per node
        atomic_replies = scripts_then_wait(
            client, atomic, script_args, durability=dur, shortfalls=shorts
        )
    elif cluster:  # redis-py's ClusterPipeline has no EVAL: one script call per result
        for d in atomic:
            try:
                atomic_replies.append(client.eval(*script_args(d)))
            except (redis.ResponseError, redis.ConnectionError) as exc:
                atomic_replies.append(exc)
    else:
        for d in atomic:
            pipe.eval(*script_args(d))
        if wait_scripts:
            pipe.execute_command("WAIT", dur.replicas, dur.timeout_ms)
    if not durable:
        for d in split:
            pipe.xadd(d.reply_to, {PAYLOAD_FIELD: d.payload}, maxlen=maxlen, approximate=True)
    queued = (split and not durable) or (atomic and not cluster)
    replies = pipe.execute(raise_on_error=False) if queued else []
    if not cluster:
        atomic_replies, replies = replies[: len(atomic)], replies[len(atomic) :]
        if wait_scripts:
            waited = replies.pop() if replies else None
            if isinstance(waited, Exception) or int(waited or 0) < dur.replicas:
                shorts.append(ONE_SCRIPT)
    if split and durable:
        replies = write_then_wait(
            client,
            split,
            maxlen=maxlen,
            reply_ttl_s=reply_ttl_s,
            durability=dur,
            shortfalls=shorts,
        )
    elif split and reply_ttl_s > 0:
        for d, reply in zip(split, replies, strict=True):
            if not isinstance(reply, Exception):
                with contextlib.suppress(redis.ResponseError):  # EXPIRE NX: Redis >= 7
                    client.expire(d.reply_to, reply_ttl_s, nx=True)
    to_ack = list(ack_only)
    for d, reply in zip(atomic, atomic_replies, strict=True):
        if isinstance(reply, Exception):
            failures.append((d, error_text(reply)))
        elif int(reply[0]) == 2:
            if superseded is not None:
                superseded.append(d)
        elif not int(reply[0]):
            failures.append((d, as_text(reply[1])))
    for d, reply in zip(split, replies, strict=True):
        if isinstance(reply, Exception):
            failures.append((d, error_text(reply)))
        else:
            to_ack.append(d)
    ack(client, group, [(d.stream, d.entry_id) for d in to_ack])
    return failures


def ack(client: Any, group: str, entries: Iterable[tuple[str, str]]) -> None:
    """``XACK`` entries, one command per stream."""
    by_stream: dict[str, list[str]] = {}
    for stream, entry_id in entries:
        by_stream.setdefault(stream, []).append(entry_id)
    if not by_stream:
        return
    pipe = client.pipeline(transaction=False)
    for stream, ids in by_stream.items():
        pipe.xack(stream, group, *ids)
    pipe.execute()


def dead_letter(
    client: Any,
    group: str,
    entry: Entry,
    dead_stream: str,
    *,
    reason: str,
    consumer: str,
    maxlen: int,
    reply_to: str | None = None,
    result: bytes | None = None,
    result_maxlen: int | None = None,
    reply_ttl_s: int = 0,
) -> str:
    """Move ``entry`` to ``dead_stream`` (fields: payload, reason, stream, id, deliveries,
    consumer, at_ms), write ``result`` (the producer's ``dead_letter`` error) to ``reply_to``
    when given, and ack the entry.

    Where the keys share a slot (always on a standalone server) this is one script: it first
    checks that ``consumer`` still holds the entry (returns ``"superseded"`` and does nothing
    when another consumer took it over), and it leaves the entry pending when the dead-letter
    write fails (raising :class:`~worker.streams.TransientRedisError` for a refusal to retry,
    else ``redis.ResponseError``). A result that cannot be written does not stop the
    dead-lettering (the return value then says ``"ok; result not written: ..."``). Returns
    ``"ok"`` otherwise.
    """
    fields: list[Any] = [
        "payload",
        entry.payload if entry.payload is not None else b"",
        "reason",
        reason,
        "stream",
        entry.stream,
        "id",
        entry.id,
        "deliveries",
        entry.deliveries,
        "consumer",
        consumer,
        "at_ms",
        int(time.time() * 1000),
    ]
    with_reply = reply_to is not None and result is not None
    if not is_cluster(client) or (
        same_slot(dead_stream, entry.stream)
        and (not with_reply or same_slot(str(reply_to), entry.stream))
    ):
        keys = [dead_stream, entry.stream] + ([str(reply_to)] if with_reply else [])
        reply = client.eval(
            DEAD_ACK, len(keys), *keys, group, entry.id, maxlen, consumer,
            result if with_reply else b"", result_maxlen or maxlen, reply_ttl_s, *fields,
        )  # fmt: skip
        code, detail = int(reply[0]), as_text(reply[1])
        if code == 2:
            return "superseded"
        if code == 0:
            if is_transient(detail):
                raise TransientRedisError(detail)
            raise redis.ResponseError(detail)
        return f"ok; result not written: {detail}" if detail else "ok"
    # Keys in different Cluster slots: result, dead letter, then ack (never ack first).
    note = "ok"
    if with_reply:
        try:
            client.xadd(
                reply_to,
                {PAYLOAD_FIELD: result},
                maxlen=result_maxlen or maxlen,
                approximate=True,
            )
        except redis.ResponseError as exc:
            if is_transient(exc):
                raise TransientRedisError(str(exc)) from exc
            note = f"ok; result not written: {exc}"
    try:
        client.xadd(
            dead_stream,
            dict(zip(fields[::2], fields[1::2], strict=True)),
            maxlen=maxlen,
            approximate=True,
        )
    except redis.ResponseError as exc:
        if is_transient(exc):
            raise TransientRedisError(str(exc)) from exc
        raise
    client.xack(entry.stream, group, entry.id)
    return note


__all__ = ["Delivery", "ack", "dead_letter", "write_results"]
