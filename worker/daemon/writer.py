"""Writing an outbox: every result before its ack, then every dead letter.

:class:`OutboxWriter` holds the job context (config, metrics, in-flight set, dead-letter naming)
and writes one :class:`~worker.daemon.context.Outbox` per call. Items leave the outbox as they are
done, so a retry after a connection error does not rewrite them; the outbox counts the jobs that
finished (``Outbox.finished``), across retries.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from worker import streams
from worker.daemon.context import DeadLetter, JobContext, Outbox, Reply
from worker.protocol import encode_result

log = logging.getLogger(__name__)


class OutboxWriter:
    """Writes results and dead letters of a :class:`JobContext`'s worker."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx

    def flush(self, client: Any, outbox: Outbox) -> int:
        """Write ``outbox``; returns ``outbox.finished``, its jobs answered or dead-lettered so far.

        A write the server refuses for now (memory full, failover: :func:`streams.is_transient`)
        stays in the outbox and :class:`streams.TransientRedisError` is raised, so the caller
        backs off and retries as after a lost connection (a connection error propagates the same
        way). A result refused for good (the reply stream is not a stream) dead-letters its job.
        An entry that cannot even be dead-lettered is released (its lease lapses) and stays
        pending, to be retried after ``claim_idle_ms``.
        """
        if outbox.results:
            self._write_results(client, outbox)
        while outbox.dead:
            outbox.finished += self._dead_letter(client, outbox.dead[0])
            outbox.dead.pop(0)
        return outbox.finished

    def _write_results(self, client: Any, outbox: Outbox) -> None:
        cfg = self.ctx.config
        deliveries = [
            streams.Delivery(r.entry.stream, r.entry.id, r.reply_to, encode_result(r.result))
            for r in outbox.results
        ]
        superseded: list[streams.Delivery] = []
        shortfalls: list[str] = []
        try:
            failures = streams.write_results(
                client,
                cfg.group,
                deliveries,
                maxlen=cfg.result_maxlen,
                consumer=cfg.consumer,
                superseded=superseded,
                reply_ttl_s=cfg.reply_ttl_s,
                durability=cfg.durability,
                shortfalls=shortfalls,
            )
        finally:
            for write in shortfalls:
                self.ctx.metrics.durable_shortfalls.labels(write=write).inc()
            if shortfalls:
                log.warning(
                    "%d WAIT(s) after result writes got fewer than %d replicas (%s)",
                    len(shortfalls),
                    cfg.durable_replicas,
                    ", ".join(shortfalls),
                )
        failed = {(d.stream, d.entry_id): err for d, err in failures}
        taken = {(d.stream, d.entry_id) for d in superseded}
        retry: list[Reply] = []
        for item in outbox.results:
            entry, res = item.entry, item.result
            err = failed.get((entry.stream, entry.id))
            if (entry.stream, entry.id) in taken:
                log.info(
                    "%s/%s was taken over by another consumer; its result is theirs",
                    entry.stream,
                    entry.id,
                )
                self._superseded(entry)
            elif err is not None and streams.is_transient(err):
                retry.append(item)
            elif err is not None:
                log.warning("result of %s could not be written (%s); dead-lettering", res.id, err)
                outbox.dead.append(DeadLetter(entry, f"reply_failed: {err}", None, None))
            else:
                outbox.finished += self._finish(entry, res.code or "ok")
        outbox.results[:] = retry
        if retry:
            first = failed[(retry[0].entry.stream, retry[0].entry.id)]
            raise streams.TransientRedisError(f"{len(retry)} results refused for now: {first}")

    def _dead_letter(self, client: Any, item: DeadLetter) -> int:
        """Dead-letter one entry: 1 when its job finished, 0 if it stays pending or is not ours."""
        cfg, ctx = self.ctx.config, self.ctx
        entry, reason, dead_res, reply_to = item
        dead = ctx.dead_stream_of(entry.stream)
        try:
            done = streams.dead_letter(
                client, cfg.group, entry, dead, reason=reason, consumer=cfg.consumer,
                maxlen=cfg.dead_letter_maxlen, reply_to=reply_to,
                result=encode_result(dead_res) if dead_res is not None else None,
                result_maxlen=cfg.result_maxlen, reply_ttl_s=cfg.reply_ttl_s,
            )  # fmt: skip
        except redis.ResponseError as exc:
            if streams.is_transient(exc):
                raise
            log.error(
                "%s/%s cannot be dead-lettered to %s (%s); it stays pending",
                entry.stream,
                entry.id,
                dead,
                streams.error_text(exc),
            )
            ctx.metrics.loop_errors.labels(where="dead_letter").inc()
            ctx.in_flight.discard(entry.stream, entry.id)
            return 0
        if done == "superseded":
            log.info(
                "%s/%s was taken over by another consumer; not dead-lettered",
                entry.stream,
                entry.id,
            )
            self._superseded(entry)
            return 0
        if done != "ok" and dead_res is not None:
            log.warning("dead_letter result for %s: %s", dead_res.id, done)
        ctx.metrics.dead_lettered.labels(reason=reason.split(":", 1)[0]).inc()
        log.warning("dead-lettered %s/%s to %s: %s", entry.stream, entry.id, dead, reason)
        return self._finish(entry, "dead_letter")

    def _superseded(self, entry: streams.Entry) -> None:
        self.ctx.in_flight.discard(entry.stream, entry.id)
        self.ctx.metrics.superseded.inc()

    def _finish(self, entry: streams.Entry, outcome: str) -> int:
        self.ctx.in_flight.done(entry.stream, entry.id)
        self.ctx.metrics.record_job(outcome, self.ctx.config.queue_of(entry.stream))
        if entry.enqueued_ms:
            e2e = max(time.time() - entry.enqueued_ms / 1000.0, 0.0)
            self.ctx.metrics.end_to_end_seconds.observe(e2e)
        return 1
