"""The producer API: submit rollouts to the scoring queue and read their scores back.

Three lines score a batch::

    from worker.client import ScoringClient
    with ScoringClient("redis://127.0.0.1:6379/0") as client:
        scores = client.score([{"tokens": ids, "prompt_len": 12}, (ids2, 7)], timeout=60)

This package imports redis, msgpack and the standard library only (numpy when it is installed):
never torch or transformers. Torch tensors and numpy arrays are accepted duck-typed.

Each client owns one reply stream (``keys.reply_stream(job_streams[0], client_id)``). A background
reader (a thread, or a task for ``AsyncScoringClient``) reads it with ``XREAD BLOCK``, buffers
results by job id, deletes what it read (``XDEL``), keeps a TTL on the key, and drops duplicate
results (``client.duplicates``). ``close()`` deletes the stream, or leaves it to expire when jobs
are still outstanding.

Memory stays bounded: a job the caller gives up on (``forget``; ``score`` after a timeout;
``score_many`` for the jobs still in flight when it stops) is dropped with its buffered result, and
its late result is dropped on arrival (``client.late_results``). Results for job ids the client is
not waiting for are kept up to ``MAX_UNCLAIMED_RESULTS``, oldest dropped first.

Modules: ``core`` (the sans-I/O core both clients drive: payloads, handles, waiting, the reply
reader; ``effects``, what it yields) with ``window`` (``score_many``), ``buffer``
(``ReplyBuffer``), ``resubmit`` (overdue jobs added again) and ``workers`` (the queue rule:
served, known or refused), ``sync`` (``ScoringClient``) and ``aio`` (``AsyncScoringClient``)
doing the I/O, ``base`` (what the two expose), ``coalesce`` (``Coalescer``: concurrent small
calls into multi-sequence jobs), ``errors`` (the ``JobFailed`` tree), ``results`` and
``inputs``. Import from here.
"""

from __future__ import annotations

from worker.client.buffer import MAX_UNCLAIMED_RESULTS, ReplyBuffer
from worker.client.errors import (
    FAILED_BY_CODE,
    BadRequestError,
    ClientClosed,
    DeadLetterError,
    ExpiredError,
    InternalJobError,
    JobFailed,
    ModelNotFoundError,
    QueueFullError,
    ScoringTimeout,
    TooLargeError,
    TooLongError,
    UnknownQueueError,
    UnsupportedModeError,
    job_failed,
)
from worker.client.inputs import JobSpec, as_job_spec, normalize_seq, normalize_seqs
from worker.client.results import JobHandle, ScoreResult, SeqScore, unwrap
from worker.client.sync import ScoringClient

__all__ = [
    "FAILED_BY_CODE",
    "MAX_UNCLAIMED_RESULTS",
    "BadRequestError",
    "ClientClosed",
    "DeadLetterError",
    "ExpiredError",
    "InternalJobError",
    "JobFailed",
    "JobHandle",
    "JobSpec",
    "ModelNotFoundError",
    "QueueFullError",
    "ReplyBuffer",
    "ScoreResult",
    "ScoringClient",
    "ScoringTimeout",
    "SeqScore",
    "TooLargeError",
    "TooLongError",
    "UnknownQueueError",
    "UnsupportedModeError",
    "as_job_spec",
    "job_failed",
    "normalize_seq",
    "normalize_seqs",
    "unwrap",
]
