"""Worker heartbeats: what each live worker of a queue serves and holds (``scoring-worker info``).

A worker writes its heartbeat from its stats step (every ``stats_interval_s``) in one pipeline
(no MULTI: a partial write is harmless) on keys that share the queue's hash tag (one Cluster
slot):

* ``HSET scoring:{q}:worker:<consumer>`` the fields (model, dtype, device, backend, and
  ``resident``: a JSON object of what the scorer holds) + ``PEXPIRE`` it (the TTL);
* ``ZADD scoring:{q}:workers`` the consumer with the Unix time its heartbeat expires +
  ``ZREMRANGEBYSCORE`` of members whose heartbeat expired long ago + ``PEXPIRE`` of the index.

A worker that dies stops renewing: its hash expires after the TTL and ``read_heartbeats`` no
longer lists it. Readers send ``ZRANGE`` + ``HGETALL`` + ``PTTL`` (read only).
"""

from __future__ import annotations

import json
import time
from typing import Any

from worker import keys
from worker.streams.reading import as_text

#: Index members whose heartbeat expired more than this long ago are dropped by the next beat.
PRUNE_AFTER_S = 300.0


def write_heartbeat(
    client: Any, queue: str, consumer: str, fields: dict[str, Any], ttl_s: float
) -> None:
    """Publish ``consumer``'s heartbeat (``fields``; dicts and lists go as JSON) for ``ttl_s``."""
    key, index = keys.worker_heartbeat(queue, consumer), keys.workers_index(queue)
    mapping = {
        k: json.dumps(v, sort_keys=True) if isinstance(v, (dict, list, tuple)) else str(v)
        for k, v in fields.items()
        if v is not None
    }
    ttl_ms = max(int(ttl_s * 1000), 1)
    now = time.time()
    pipe = client.pipeline(transaction=False)  # one round trip; a partial write is harmless
    pipe.hset(key, mapping={"consumer": consumer, "updated_at": f"{now:.3f}", **mapping})
    pipe.pexpire(key, ttl_ms)
    pipe.zadd(index, {consumer: now + ttl_s})
    pipe.zremrangebyscore(index, "-inf", now - PRUNE_AFTER_S)
    pipe.pexpire(index, ttl_ms + int(PRUNE_AFTER_S * 1000))
    pipe.execute()


def read_heartbeats(client: Any, queue: str) -> list[dict[str, Any]]:
    """The live heartbeats of ``queue``, by consumer name; JSON fields decoded, plus
    ``ttl_s`` (seconds until the heartbeat expires)."""
    members = sorted(as_text(m) for m in client.zrange(keys.workers_index(queue), 0, -1))
    if not members:
        return []
    pipe = client.pipeline(transaction=False)
    for consumer in members:
        key = keys.worker_heartbeat(queue, consumer)
        pipe.hgetall(key)
        pipe.pttl(key)
    replies = pipe.execute()
    out = []
    for i in range(len(members)):
        raw, ttl_ms = replies[2 * i], replies[2 * i + 1]
        if not raw:
            continue  # expired: the worker stopped beating
        beat: dict[str, Any] = {}
        for k, v in raw.items():
            text = as_text(v)
            name = as_text(k)
            beat[name] = json.loads(text) if text[:1] in "{[" else text
        beat["ttl_s"] = ttl_ms / 1000 if ttl_ms and ttl_ms > 0 else None
        out.append(beat)
    return out
