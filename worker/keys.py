"""Stream key naming. Every key carries a Redis Cluster hash tag (``{...}``).

A logical queue ``q`` with one partition is the stream ``scoring:{q}:jobs``; with N partitions it is
``scoring:{q:0}:jobs`` .. ``scoring:{q:N-1}:jobs``, each tag hashing to its own slot. A partition's
dead-letter stream (``...:dead``) shares its tag, and so does a reply stream created for it, so the
result write and the ack of a job can run in one MULTI on Cluster too.
"""

from __future__ import annotations

import re

from worker.errors import ConfigError

PREFIX = "scoring"
DEFAULT_QUEUE = "default"
DEFAULT_GROUP = "scoring"
_QUEUE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def validate_queue(queue: str) -> str:
    """Return ``queue`` if it is a valid logical queue name, else raise ``ConfigError``."""
    if not _QUEUE_RE.match(queue):
        raise ConfigError(f"queue name must match {_QUEUE_RE.pattern}, got {queue!r}")
    return queue


def job_streams(queue: str = DEFAULT_QUEUE, partitions: int = 1) -> list[str]:
    """The job stream keys of a logical queue, one per partition."""
    validate_queue(queue)
    if partitions < 1:
        raise ConfigError(f"partitions must be >= 1, got {partitions}")
    if partitions == 1:
        return [f"{PREFIX}:{{{queue}}}:jobs"]
    return [f"{PREFIX}:{{{queue}:{p}}}:jobs" for p in range(partitions)]


def hash_tag(key: str) -> str | None:
    """The hash tag of ``key`` as Redis Cluster computes it (first ``{...}`` non-empty), or None."""
    start = key.find("{")
    if start < 0:
        return None
    end = key.find("}", start + 1)
    if end <= start + 1:
        return None
    return key[start + 1 : end]


def _base(job_stream: str) -> str:
    return job_stream[: -len(":jobs")] if job_stream.endswith(":jobs") else job_stream


def dead_letter_stream(job_stream: str) -> str:
    """The dead-letter stream of a job stream (same hash tag)."""
    return f"{_base(job_stream)}:dead"


def handback_key(job_stream: str) -> str:
    """The hash where draining workers note that they handed entries of ``job_stream`` back
    (field: consumer name, value: a counter the other workers watch), in the stream's slot: its
    hash tag, or, for a stream key without one, the whole key as the tag."""
    if hash_tag(job_stream) is None:
        return f"{{{job_stream}}}:handback"
    return f"{_base(job_stream)}:handback"


def reply_stream(job_stream: str, client_id: str) -> str:
    """A producer's reply stream sharing ``job_stream``'s hash tag."""
    return f"{_base(job_stream)}:replies:{client_id}"


# worker heartbeats (what each live worker holds; ``scoring-worker info``)
def workers_index(queue: str) -> str:
    """The sorted set of a queue's workers that sent a heartbeat (member: consumer name, score:
    the Unix time its heartbeat expires). Tag ``{queue}``, like the heartbeats it lists."""
    return f"{PREFIX}:{{{validate_queue(queue)}}}:workers"


def worker_heartbeat(queue: str, consumer: str) -> str:
    """A worker's heartbeat hash (expires unless renewed); same slot as ``workers_index``."""
    return f"{PREFIX}:{{{validate_queue(queue)}}}:worker:{consumer}"


def queue_of(job_stream: str) -> str | None:
    """The logical queue of a key ``job_streams`` makes (``None`` for any other key)."""
    tag = hash_tag(job_stream)
    if tag is None or job_stream != f"{PREFIX}:{{{tag}}}:jobs":
        return None
    queue, _, part = tag.partition(":")
    if part and not part.isdigit():
        return None
    return queue if _QUEUE_RE.match(queue) else None


def queue_of_key(key: str) -> str | None:
    """The logical queue of a job stream (``queue_of``) or of a workers index
    (``workers_index``); ``None`` for any other key. What ``info --list`` and a producer's
    refusal of an unknown queue list."""
    if key.endswith(":jobs"):
        return queue_of(key)
    tag = hash_tag(key)
    if tag is None or key != f"{PREFIX}:{{{tag}}}:workers":
        return None
    return tag if _QUEUE_RE.match(tag) else None


#: The ``SCAN MATCH`` patterns of the keys ``queue_of_key`` reads a queue from.
QUEUE_KEY_PATTERNS = (f"{PREFIX}:{{*}}:jobs", f"{PREFIX}:{{*}}:workers")


def same_slot(a: str, b: str) -> bool:
    """True when two keys hash to the same Cluster slot."""
    from redis.crc import key_slot

    return bool(key_slot(a.encode()) == key_slot(b.encode()))
