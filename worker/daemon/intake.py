"""Intake: decode and validate one entry, and say what becomes of it.

A good job becomes a ``Pending`` for the backlog; anything else is answered at once: an error
result (``bad_request``, ``expired``, the scorer's ``too_long`` / ``unsupported_mode``, ...) or the
dead-letter stream (delivered too often, no payload, no ``reply_to`` to answer). Nothing is
written here: the caller queues what :func:`prepare_entry` returns.
"""

from __future__ import annotations

import time

import numpy as np

from worker import streams
from worker.daemon.context import DeadLetter, JobContext, Pending, Reply
from worker.errors import ProtocolError, ScoringError
from worker.protocol import Job, decode_job, error_result, peek_envelope
from worker.scorer import ScoreOptions, SequenceInput


def job_options(job: Job) -> ScoreOptions:
    """The scorer options a decoded job asks for (defaults: today's plain job)."""
    return ScoreOptions()


def seq_inputs(job: Job) -> list[SequenceInput]:
    """Scorer inputs of a job: int32 token arrays (zero-copy), prompt_len or the 0/1 mask bytes."""
    out = []
    for s in job.seqs:
        tokens = np.frombuffer(s.tokens, dtype=np.int32) if len(s.tokens) else np.zeros(0, np.int32)
        out.append(SequenceInput(tokens=tokens, prompt_len=s.prompt_len, mask=s.mask))
    return out


def prepare_entry(
    ctx: JobContext, entry: streams.Entry, now_s: float | None = None
) -> Pending | Reply | DeadLetter:
    """Decode and validate one entry: a ``Pending`` job, or the answer it gets right away."""
    cfg = ctx.config
    now_s = time.time() if now_s is None else now_s
    if entry.deliveries > 1:
        ctx.metrics.redelivered.inc()
    if entry.enqueued_ms:
        ctx.metrics.queue_wait_seconds.observe(max(now_s - entry.enqueued_ms / 1000.0, 0.0))
    env = peek_envelope(entry.payload, cfg.limits) if entry.payload else {}
    job_id = env.get("id", entry.id)
    reply_to = env.get("reply_to")
    meta = env.get("meta")

    def answer(code: str, message: str, **extra: object) -> Reply:
        res = error_result(job_id, code, message, meta=meta, info=ctx.info(**extra))
        return Reply(entry, reply_to, res, now_s)

    if entry.deliveries > cfg.max_deliveries:
        msg = f"delivered {entry.deliveries} times (max_deliveries={cfg.max_deliveries})"
        res = error_result(job_id, "dead_letter", msg, meta=meta, info=ctx.info())
        return DeadLetter(entry, f"max_deliveries: {msg}", res, reply_to)
    if entry.payload is None:
        return DeadLetter(entry, "undecodable: entry has no payload field", None, None)
    try:
        job = decode_job(entry.payload, cfg.limits)
    except ProtocolError as exc:
        if reply_to is None:
            return DeadLetter(entry, f"no_reply_to: {exc.message}", None, None)
        return answer("bad_request", exc.message)
    if job.deadline_ms is not None and now_s * 1000 > job.deadline_ms:
        late = now_s * 1000 - job.deadline_ms
        return answer("expired", f"still queued {late:.0f} ms after deadline_ms", temperature=None)
    inputs = seq_inputs(job)
    pending = Pending(
        entry=entry, job=job, inputs=inputs, read_at_s=now_s, options=job_options(job)
    )
    mode, temperature, options = pending.key
    try:
        ctx.scorer.validate(inputs, mode, temperature, options)
    except ScoringError as exc:
        return answer(exc.code, exc.message)
    return pending
