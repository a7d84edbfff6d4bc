"""Intake: decode one entry, have the scorer prepare it, and say what becomes of it.

A good job becomes a ``Pending`` for the backlog, holding the ``Prepared`` request its scorer
planned (``Scorer.prepare``, once; ``Scorer.run`` later runs that plan); anything else is
answered at once: an error result (``bad_request``, ``expired``, the scorer's ``too_long`` /
``unsupported_mode``, ...) or the dead-letter stream (delivered too often, no payload, no
``reply_to`` to answer). Nothing is written here: the caller queues what :func:`prepare_entry`
returns.
"""

from __future__ import annotations

import time
from typing import cast

import numpy as np

from worker import streams
from worker.daemon.context import DeadLetter, JobContext, Pending, Reply
from worker.errors import ProtocolError, ScoringError
from worker.modes import Mode
from worker.protocol import Job, decode_job, error_result, peek_envelope
from worker.request import ScoreRequest, SequenceInput
from worker.scorer.teacher import check_limits


def seq_inputs(job: Job) -> list[SequenceInput]:
    """Scorer inputs of a job: int32 token arrays (zero-copy), prompt_len or the 0/1 mask bytes."""
    out = []
    for s in job.seqs:
        tokens = np.frombuffer(s.tokens, dtype=np.int32) if len(s.tokens) else np.zeros(0, np.int32)
        gather = None  # teacher outputs: per-position ids [n_scored, K]
        if s.gather_ids is not None and job.gather_width:
            gather = np.frombuffer(s.gather_ids, np.int32).reshape(-1, job.gather_width)
        out.append(
            SequenceInput(
                tokens=tokens, prompt_len=s.prompt_len, mask=s.mask, gather_ids=gather,
                messages=s.messages,  # reward inputs: rendered by the scorer's prepare
                text=s.text,  # tokenized by the scorer's prepare
                step_positions=s.step_positions,
                images=s.images,  # indices into the job's images
                student=s.student,  # tokenized by the scorer's prepare (its own tokenizer)
            )
        )  # fmt: skip
    return out


def hidden_size(ctx: JobContext) -> int:
    """H of the scorer's ``hidden`` rows (its ``info["head"]``; 0 when it serves none)."""
    head = ctx.scorer.info.get("head")
    return int(head.get("hidden_size") or 0) if isinstance(head, dict) else 0


def prepare_entry(
    ctx: JobContext, entry: streams.Entry, now_s: float | None = None
) -> Pending | Reply | DeadLetter:
    """Decode and prepare one entry: a ``Pending`` job, or the answer it gets right away."""
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
    options = job.options  # decoded once, into the request types (worker.request)
    try:
        n_scored = sum(s.num_scored for s in job.seqs)
        check_limits(
            options.outputs, n_scored, max_topk=cfg.max_topk, max_bytes=cfg.max_result_bytes,
            hidden_size=hidden_size(ctx) if "hidden" in options.outputs.outputs else 0,
            extra_bytes=sum(  # student text: per teacher token its id and span, per run 5 ints
                12 * s.num_scored + 20 * len(s.student.cuts()) for s in job.seqs if s.student
            ),
        )  # fmt: skip
        # validated and planned once: render messages / tokenize text for the reward model,
        # check every sequence, decide the calls (off the forward); what runs is this plan
        started = time.perf_counter()
        request = ScoreRequest(
            seq_inputs(job), cast(Mode, job.mode), job.temperature, options, images=job.images
        )
        prepared = ctx.scorer.prepare(request)
        if any(s.messages is not None or s.text is not None for s in job.seqs):
            ctx.metrics.tokenization_seconds.observe(time.perf_counter() - started)
    except ScoringError as exc:
        return answer(exc.code, exc.message)
    if job.mode != "reward":
        for name in options.outputs.outputs:
            ctx.metrics.outputs_requested.labels(output=name).inc()
    return Pending(entry=entry, job=job, prepared=prepared, read_at_s=now_s)
