"""The worker daemon: read jobs from Redis Streams, batch them, score, write results, ack.

One loop in the main thread (read -> decode/validate -> batch under the token budget -> hand the
batch to the compute thread -> write results and ack; pipelined, so reading the next batch and
writing the previous one overlap the forward), a lease thread that keeps in-flight entries owned
while a batch runs, periodic reclaim of entries whose consumer died, dead-lettering past
``max_deliveries``, graceful drain on SIGTERM/SIGINT and reconnects when Redis goes away. Commands
on the wire live in ``worker.streams``; the daemon drives a ``worker.scorer.Scorer`` and never
imports torch.

Modules, one role each:

* ``worker``: :class:`Worker`, the loop that wires the roles together;
* ``pipeline``: the compute stage (one batch scoring on its own thread, or inline with
  ``--no-pipeline``);
* ``context``: shared data (``Pending``, ``Reply``, ``DeadLetter``, ``Outbox``, ``JobContext``);
* ``intake``: decode an entry and prepare it (``Scorer.prepare``); ``jobs``: run a batch of
  prepared jobs (``Scorer.run``) into results;
  ``writer``: write an outbox (result before ack, dead letters);
* ``backlog``: held jobs per queue and batch taking (several queues share the batches by weight);
  ``reader``: read (per queue) and reclaim entries;
  ``link``: the loop's connection and backoff; ``stats``: stream gauges;
* ``drain``: stop request, drain deadline, signal watcher; ``leases``: in-flight set and lease
  keeper. The child processes of ``serve --replicas`` are :mod:`worker.processes`'.
"""

from __future__ import annotations

from worker.daemon.context import DeadLetter, JobContext, Outbox, Pending, Reply
from worker.daemon.worker import Worker

__all__ = ["DeadLetter", "JobContext", "Outbox", "Pending", "Reply", "Worker"]
