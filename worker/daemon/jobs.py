"""What the daemon does with each job: decode/validate, score a batch, write the outcome.

Split out of ``worker.daemon`` (which owns the loop, Redis plumbing and lifecycle) to keep both
modules readable. Every job ends in exactly one of: an ``ok`` result, an error result with a typed
code, or the dead-letter stream (plus a ``dead_letter`` result when the producer is reachable).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import redis

from worker import streams
from worker.daemon import Outbox, Pending, job_info, load_fallbacks, seq_inputs
from worker.errors import KVCacheRejected, ProtocolError, ScoringError
from worker.protocol import (
    Result,
    SeqResult,
    decode_job,
    encode_result,
    error_result,
    peek_envelope,
)
from worker.scorer.inputs import SequenceInput

if TYPE_CHECKING:
    from worker.daemon import Worker

log = logging.getLogger(__name__)


def prepare_entry(worker: Worker, entry: streams.Entry, outbox: Outbox) -> None:
    """Decode and validate one entry: a good job joins the backlog, anything else is answered."""
    cfg = worker.config
    now_s = time.time()
    if entry.enqueued_ms:
        worker.metrics.queue_wait_seconds.observe(max(now_s - entry.enqueued_ms / 1000.0, 0.0))
    env = peek_envelope(entry.payload, cfg.limits) if entry.payload else {}
    job_id = env.get("id", entry.id)
    reply_to = env.get("reply_to")
    meta = env.get("meta")

    def answer(code: str, message: str, **extra: Any) -> None:
        info = job_info(worker.scorer, cfg.consumer, **extra)
        res = error_result(job_id, code, message, meta=meta, info=info)
        outbox.results.append((entry, reply_to, res, now_s))

    if entry.deliveries > cfg.max_deliveries:
        msg = f"delivered {entry.deliveries} times (max_deliveries={cfg.max_deliveries})"
        info = job_info(worker.scorer, cfg.consumer)
        res = error_result(job_id, "dead_letter", msg, meta=meta, info=info)
        outbox.dead.append((entry, f"max_deliveries: {msg}", res, reply_to))
        return
    if entry.payload is None:
        outbox.dead.append((entry, "undecodable: entry has no payload field", None, None))
        return
    try:
        job = decode_job(entry.payload, cfg.limits)
    except ProtocolError as exc:
        if reply_to is None:
            outbox.dead.append((entry, f"no_reply_to: {exc.message}", None, None))
        else:
            answer("bad_request", exc.message)
        return
    if job.deadline_ms is not None and now_s * 1000 > job.deadline_ms:
        late = now_s * 1000 - job.deadline_ms
        answer("expired", f"still queued {late:.0f} ms after deadline_ms", temperature=None)
        return
    inputs = seq_inputs(job, SequenceInput)
    try:
        worker.scorer.validate(inputs, job.mode, job.temperature)
    except ScoringError as exc:
        answer(exc.code, exc.message)
        return
    worker.backlog.append(Pending(entry=entry, job=job, inputs=inputs, read_at_s=now_s))


def score_batch(worker: Worker, batch: list[Pending], outbox: Outbox) -> None:
    """Score ``batch`` in one executor call; on failure split it in halves to isolate the job
    that breaks it. Per-sequence errors become that job's error result."""
    mode, temperature = batch[0].key
    seqs = [x for p in batch for x in p.inputs]
    started = time.perf_counter()
    try:
        out = worker.scorer.score(seqs, mode=mode, temperature=temperature)
    except KVCacheRejected as exc:
        worker.metrics.kv_rejected.inc()
        worker.metrics.kv_bytes.inc(exc.kv_output_bytes)
        log.error("batch of %d jobs rejected: %s", len(batch), exc)
        _fail(worker, batch, outbox, "internal", exc.message)
        return
    except Exception as exc:
        if len(batch) > 1:
            log.warning("batch of %d jobs failed (%s); splitting it", len(batch), exc)
            mid = len(batch) // 2
            score_batch(worker, batch[:mid], outbox)
            score_batch(worker, batch[mid:], outbox)
            return
        if isinstance(exc, ScoringError):
            _fail(worker, batch, outbox, exc.code, exc.message)
        else:
            log.exception("job %s failed alone", batch[0].job.id)
            _fail(worker, batch, outbox, "internal", f"{type(exc).__name__}: {exc}")
        return
    m = out.metrics
    compute_ms = (time.perf_counter() - started) * 1000.0
    worker.metrics.record_batch(
        batch_size=m.batch_size, real_tokens=m.real_tokens, scored_tokens=m.scored_tokens,
        padded_tokens=m.padded_tokens, packed_fill_tokens=m.packed_fill_tokens,
        forward_s=m.forward_s, elapsed_s=m.elapsed_s,
        peak_allocated_bytes=m.peak_allocated_bytes, peak_reserved_bytes=m.peak_reserved_bytes,
        kv_output_bytes=m.kv_output_bytes, kv_rejected=m.kv_rejected, oom_splits=m.oom_splits,
        device_total_bytes=m.device_total_bytes or None, now_s=time.time(),
    )  # fmt: skip
    if m.backend and m.backend != "none":
        worker.metrics.set_backend(m.backend)
    reasons = [f"{f.requested}->{f.used}: {f.reason}" for f in m.fallbacks]
    at_load = [
        f"{f.requested}->{f.used}: {f.reason} (at load)" for f in load_fallbacks(worker.scorer)
    ]
    common = {
        "attention_backend": m.backend,
        "requested_backend": m.requested_backend,
        "fallback": bool(reasons or at_load),
        "fallback_reason": "; ".join(at_load + reasons) or None,
        "temperature": temperature,
        "compute_ms": round(compute_ms, 3),
    }
    i = 0
    for p in batch:
        scores = out.scores[i : i + len(p.inputs)]
        i += len(p.inputs)
        queue_ms = round(max(p.read_at_s * 1000.0 - p.entry.enqueued_ms, 0.0), 3)
        info = job_info(worker.scorer, worker.config.consumer, queue_ms=queue_ms, **common)
        bad = [(k, s.error) for k, s in enumerate(scores) if s.error is not None]
        if bad:
            k, err = bad[0]
            code = getattr(err, "code", "internal")
            msg = f"seqs[{k}]: {getattr(err, 'message', str(err))}"
            res = error_result(p.job.id, code, msg, meta=p.job.meta, info=info)
        else:
            seq_results = [
                SeqResult(logps=s.logps, reward=s.reward, token_scores=s.token_scores)
                for s in scores
            ]
            res = Result(id=p.job.id, ok=True, seqs=seq_results, meta=p.job.meta, info=info)
        outbox.results.append((p.entry, p.job.reply_to, res, p.read_at_s))
    log.info(
        "batch: %d jobs, %d seqs, %d tokens, %.1f ms, backend %s%s",
        len(batch), m.batch_size, m.real_tokens, compute_ms, m.backend,
        f" (fallback: {'; '.join(reasons)})" if reasons else "",
        extra={"fields": {
            "jobs": len(batch), "seqs": m.batch_size, "tokens": m.real_tokens,
            "padded_tokens": m.padded_tokens, "compute_ms": round(compute_ms, 3),
            "backend": m.backend, "fallbacks": reasons or None,
            "peak_allocated_bytes": m.peak_allocated_bytes,
        }},
    )  # fmt: skip


def _fail(worker: Worker, batch: list[Pending], outbox: Outbox, code: str, message: str) -> None:
    for p in batch:
        info = job_info(worker.scorer, worker.config.consumer, temperature=p.job.temperature)
        res = error_result(p.job.id, code, message, meta=p.job.meta, info=info)
        outbox.results.append((p.entry, p.job.reply_to, res, p.read_at_s))


def flush_outbox(worker: Worker, outbox: Outbox) -> None:
    """Write every result (result before ack), then every dead letter; items leave the outbox
    as they are done so a retry after a connection error does not rewrite them.

    A write the server refuses for now (memory full, failover: :func:`streams.is_transient`)
    stays in the outbox and :class:`streams.TransientRedisError` is raised, so the caller backs
    off and retries as after a lost connection. A result refused for good (the reply stream is
    not a stream) dead-letters its job. An entry that cannot even be dead-lettered is released
    (its lease lapses) and stays pending, to be retried after ``claim_idle_ms``.
    """
    cfg, client = worker.config, worker.client
    if outbox.results:
        deliveries = [
            streams.Delivery(e.stream, e.id, reply_to, encode_result(res))
            for e, reply_to, res, _ in outbox.results
        ]
        superseded: list[streams.Delivery] = []
        failures = streams.write_results(
            client, cfg.group, deliveries, maxlen=cfg.result_maxlen, consumer=cfg.consumer,
            superseded=superseded, reply_ttl_s=cfg.reply_ttl_s,
        )  # fmt: skip
        failed = {(d.stream, d.entry_id): err for d, err in failures}
        taken = {(d.stream, d.entry_id) for d in superseded}
        retry: list[Any] = []
        for item in outbox.results:
            entry, _reply_to, res, _read = item
            err = failed.get((entry.stream, entry.id))
            if (entry.stream, entry.id) in taken:
                log.info("%s/%s was taken over by another consumer; its result is theirs",
                         entry.stream, entry.id)  # fmt: skip
                worker.in_flight.discard(entry.stream, entry.id)
                worker.metrics.superseded.inc()
            elif err is not None and streams.is_transient(err):
                retry.append(item)
            elif err is not None:
                log.warning("result of %s could not be written (%s); dead-lettering", res.id, err)
                outbox.dead.append((entry, f"reply_failed: {err}", None, None))
            else:
                _finish(worker, entry, res.code or "ok")
        outbox.results[:] = retry
        if retry:
            first = failed[(retry[0][0].stream, retry[0][0].id)]
            raise streams.TransientRedisError(f"{len(retry)} results refused for now: {first}")
    while outbox.dead:
        entry, reason, dead_res, reply_to = outbox.dead[0]
        dead = worker.dead_stream_of(entry.stream)
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
            log.error("%s/%s cannot be dead-lettered to %s (%s); it stays pending",
                      entry.stream, entry.id, dead, streams.error_text(exc))  # fmt: skip
            worker.metrics.loop_errors.labels(where="dead_letter").inc()
            worker.in_flight.discard(entry.stream, entry.id)
            outbox.dead.pop(0)
            continue
        if done == "superseded":
            log.info("%s/%s was taken over by another consumer; not dead-lettered",
                     entry.stream, entry.id)  # fmt: skip
            worker.in_flight.discard(entry.stream, entry.id)
            worker.metrics.superseded.inc()
            outbox.dead.pop(0)
            continue
        if done != "ok" and dead_res is not None:
            log.warning("dead_letter result for %s: %s", dead_res.id, done)
        worker.metrics.dead_lettered.labels(reason=reason.split(":", 1)[0]).inc()
        log.warning("dead-lettered %s/%s to %s: %s", entry.stream, entry.id, dead, reason)
        _finish(worker, entry, "dead_letter")
        outbox.dead.pop(0)


def _finish(worker: Worker, entry: streams.Entry, outcome: str) -> None:
    worker.in_flight.discard(entry.stream, entry.id)
    worker.jobs_done += 1
    worker.metrics.record_job(outcome)
    if entry.enqueued_ms:
        e2e = max(time.time() - entry.enqueued_ms / 1000.0, 0.0)
        worker.metrics.end_to_end_seconds.observe(e2e)
