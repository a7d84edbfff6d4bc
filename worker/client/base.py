"""What ``ScoringClient`` and ``AsyncScoringClient`` share above the core: construction, the
configuration they expose, and their counters (all read from the ``ClientCore``)."""

from __future__ import annotations

from typing import Any, TypeVar

from worker import protocol
from worker.client.buffer import ReplyBuffer
from worker.client.core import ClientCore
from worker.config import DEFAULT_REDIS_URL, RedisSettings

C = TypeVar("C", bound="ClientBase")


class ClientBase:
    """A producer client's core and the read-only view of it; the subclasses add the I/O.

    Arguments: ``redis_url`` (``redis://``, ``rediss://`` for TLS, ``redis+cluster://``),
    ``queue`` and ``partitions`` (equal to the workers' ``--queue`` and ``--partitions``), and
    keyword-only ``cluster``, ``ssl_*``, ``settings`` (a ``RedisSettings`` instead of the URL and
    TLS arguments), ``client_id`` (names the reply stream), ``mode`` (the default mode),
    ``reply_ttl_s``, ``block_ms`` (the reader's ``XREAD BLOCK``) and ``limits``.

    The queue rule (``worker.client.workers``): a submit to a queue that no worker serves nor
    ever did (no consumer group) raises ``UnknownQueueError`` and writes nothing;
    ``wait_for_unknown_queue=True`` submits anyway (a fleet that creates its group on first
    start); ``check_workers=False`` never asks. A queue with a group waits for a worker within
    the caller's timeout (scale from zero, a restart).

    Producer-side at-least-once (docs/guarantees.md): ``resubmit_after_s`` (default None: off) adds
    a job again, same id, when its result has not arrived that long after its last ``XADD``, up
    to ``max_submits`` ``XADD`` commands in all (default 3); ``durable_replicas`` (default 0:
    off) makes each ``XADD`` wait (``WAIT``) until that many replicas have it, at most
    ``durable_timeout_ms`` (default 1000; a shortfall is logged and counted in ``undurable``).
    """

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, *args: Any, **kwargs: Any) -> None:
        self._core = ClientCore(redis_url, *args, **kwargs)

    @classmethod
    def from_settings(cls: type[C], settings: RedisSettings, **kwargs: Any) -> C:
        """Build from a ``RedisSettings`` (as the CLI does)."""
        return cls(settings.url, settings=settings, **kwargs)

    # -- configuration

    @property
    def client_id(self) -> str:
        """This client's id (part of its reply stream's key)."""
        return self._core.client_id

    @property
    def settings(self) -> RedisSettings:
        """How this client reaches Redis."""
        return self._core.settings

    @property
    def queue(self) -> str:
        """The queue name."""
        return self._core.queue

    @property
    def partitions(self) -> int:
        """How many job streams the queue has."""
        return self._core.partitions

    @property
    def job_streams(self) -> list[str]:
        """The job streams (one per partition)."""
        return self._core.job_streams

    @property
    def reply_stream(self) -> str:
        """The stream the workers write this client's results to."""
        return self._core.reply_stream

    @property
    def mode(self) -> str:
        """The mode of jobs submitted without one."""
        return self._core.mode

    @property
    def reply_ttl_s(self) -> int:
        """The TTL kept on the reply stream, in seconds."""
        return self._core.reply_ttl_s

    @property
    def block_ms(self) -> int:
        """How long one ``XREAD`` of the reply reader blocks, in milliseconds."""
        return self._core.block_ms

    @property
    def limits(self) -> protocol.Limits:
        """The bounds applied when decoding results."""
        return self._core.limits

    def stream_for(self, job_id: str) -> str:
        """The job stream (partition) of ``job_id``: a stable hash of the id."""
        return self._core.stream_for(job_id)

    # -- counters

    @property
    def duplicates(self) -> int:
        """How many duplicate results (same job id) were dropped."""
        return self._core.buffer.duplicates

    @property
    def outstanding(self) -> int:
        """Jobs submitted whose result has not been taken (nor the job forgotten) yet."""
        return len(self._core.outstanding)

    @property
    def late_results(self) -> int:
        """How many results of forgotten jobs arrived late and were dropped."""
        return self._core.buffer.late

    @property
    def evicted_results(self) -> int:
        """How many unclaimed results were dropped because ``MAX_UNCLAIMED_RESULTS`` were held."""
        return self._core.buffer.evicted

    @property
    def resubmits(self) -> int:
        """How many times a job was added again because its result was overdue."""
        return self._core.resubmitter.resubmits

    @property
    def undurable(self) -> int:
        """Durable adds that fewer replicas than ``durable_replicas`` acknowledged in time."""
        return self._core.undurable

    @property
    def reconnects(self) -> int:
        """How many times the reply reader lost its connection and retried."""
        return self._core.reconnects

    @property
    def _buffer(self) -> ReplyBuffer:
        """The reply buffer (tests and the fault harness wrap its ``offer``)."""
        return self._core.buffer
