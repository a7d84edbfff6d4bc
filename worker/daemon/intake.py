"""Intake: decode and validate one entry, and say what becomes of it.

A good job becomes a ``Pending`` for the backlog; anything else is answered at once: an error
result (``bad_request``, ``expired``, the scorer's ``too_long`` / ``unsupported_mode``, ...) or the
dead-letter stream (delivered too often, no payload, no ``reply_to`` to answer). Nothing is
written here: the caller queues what :func:`prepare_entry` returns.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from worker import streams
from worker.daemon.context import DeadLetter, JobContext, Pending, Reply
from worker.errors import ProtocolError, ScoringError
from worker.protocol import Job, decode_job, error_result, peek_envelope
from worker.scorer import ScoreOptions, SequenceInput
from worker.scorer.steps import StepOptions
from worker.scorer.teacher import LOGPS_ONLY, Sampling, TokenOutputs, check_limits


def job_options(job: Job) -> ScoreOptions:
    """The scorer options a decoded job asks for (defaults: today's plain job); raises
    ``BadRequest`` for a request the scorer's spec refuses."""
    step = job.step  # process rewards
    return ScoreOptions(
        outputs=token_outputs(job),
        adapter=job.adapter,  # per-job weights: batches group by adapter and version
        version=job.version,
        step=None if step is None else StepOptions(**dataclasses.asdict(step)),
    )


def token_outputs(job: Job) -> TokenOutputs:
    """The validated teacher-output request of ``job`` (``LOGPS_ONLY`` when it names none)."""
    req = job.outputs
    if req is None:
        return LOGPS_ONLY
    return TokenOutputs(
        outputs=frozenset(req.outputs),
        topk=req.topk or 0,
        gather_ids=req.gather_ids or (),
        gather_width=job.gather_width,
        sampling=Sampling(**req.sampling) if req.sampling is not None else None,
        float16=req.float16,
    )


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
            )
        )  # fmt: skip
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
    try:
        options = job_options(job)
        n_scored = sum(s.num_scored for s in job.seqs)
        check_limits(
            options.outputs, n_scored, max_topk=cfg.max_topk, max_bytes=cfg.max_result_bytes
        )
    except ScoringError as exc:
        return answer(exc.code, exc.message)
    pending = Pending(entry=entry, job=job, inputs=inputs, read_at_s=now_s, options=options)
    mode, temperature, options = pending.key
    try:  # validate; render messages / tokenize text for the reward model (off the forward)
        started = time.perf_counter()
        pending.inputs = ctx.scorer.prepare(inputs, mode, temperature, options)
        if any(s.messages is not None or s.text is not None for s in job.seqs):
            ctx.metrics.tokenization_seconds.observe(time.perf_counter() - started)
    except ScoringError as exc:
        return answer(exc.code, exc.message)
    if job.mode != "reward":
        for name in options.outputs.outputs:
            ctx.metrics.outputs_requested.labels(output=name).inc()
    return pending
