"""Job outcomes of a batch: score it, and turn what the scorer returned into one result per job.

Every job ends in exactly one of: an ``ok`` result, an error result with a typed code, or (via
``worker.daemon.intake`` / ``worker.daemon.writer``) the dead-letter stream. The functions here take
an explicit :class:`~worker.daemon.context.JobContext` and return the results; writing them is the
caller's business.
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

from worker.daemon.context import JobContext, Pending, Reply
from worker.daemon.weights import record_weights, weights_info
from worker.errors import KVCacheRejected, ScoringError
from worker.protocol import Result, SeqResult, error_result
from worker.protocol.outputs import ARRAY_DTYPES
from worker.protocol.student import STUDENT_ARRAYS
from worker.request import ScoreOptions
from worker.scorer import ScoreOutput, SequenceScore
from worker.scorer.teacher import array_layout

log = logging.getLogger(__name__)


def score_batch(ctx: JobContext, batch: list[Pending]) -> list[Reply]:
    """Score ``batch`` in one scorer call; on failure split it in halves to isolate the job
    that breaks it. Per-sequence errors become that job's error result."""
    started = time.perf_counter()
    try:
        out = ctx.scorer.run([p.prepared for p in batch])  # as planned at intake
    except KVCacheRejected as exc:
        ctx.metrics.kv_rejected.inc()
        ctx.metrics.kv_bytes.inc(exc.kv_output_bytes)
        log.error("batch of %d jobs rejected: %s", len(batch), exc)
        return fail(ctx, batch, "internal", exc.message)
    except Exception as exc:
        if len(batch) > 1:
            log.warning("batch of %d jobs failed (%s); splitting it", len(batch), exc)
            mid = len(batch) // 2
            return score_batch(ctx, batch[:mid]) + score_batch(ctx, batch[mid:])
        if isinstance(exc, ScoringError):
            return fail(ctx, batch, exc.code, exc.message)
        log.exception("job %s failed alone", batch[0].job.id)
        return fail(ctx, batch, "internal", f"{type(exc).__name__}: {exc}")
    compute_ms = (time.perf_counter() - started) * 1000.0
    return _results(ctx, batch, out, compute_ms)


def _results(
    ctx: JobContext, batch: list[Pending], out: ScoreOutput, compute_ms: float
) -> list[Reply]:
    """Record the batch's metrics and build one result per job of it."""
    m = out.metrics
    ctx.metrics.record_batch(
        batch_size=m.batch_size, real_tokens=m.real_tokens, scored_tokens=m.scored_tokens,
        padded_tokens=m.padded_tokens, packed_fill_tokens=m.packed_fill_tokens,
        forward_tokens=m.forward_tokens, shared_prefix_tokens=m.shared_prefix_tokens,
        forward_s=m.forward_s, elapsed_s=m.elapsed_s,
        peak_allocated_bytes=m.peak_allocated_bytes, peak_reserved_bytes=m.peak_reserved_bytes,
        kv_output_bytes=m.kv_output_bytes, kv_rejected=m.kv_rejected, oom_splits=m.oom_splits,
        device_total_bytes=m.device_total_bytes or None, now_s=time.time(),
    )  # fmt: skip
    if m.images_decoded or m.image_tokens:  # a vision-language model's images
        ctx.metrics.record_images(
            decoded=m.images_decoded, cache_hits=m.processor_cache_hits,
            image_tokens=m.image_tokens, vision_s=m.vision_s, vision_images=m.vision_images,
        )  # fmt: skip
    record_weights(ctx.metrics, m.weights, len(batch))  # per-job adapters/versions
    if m.group is not None:  # a tensor-parallel group: per-rank peaks, collectives
        ctx.metrics.record_group(m.group.rank_peak_bytes, m.group.collective_s)
    if m.backend and m.backend != "none":
        ctx.metrics.set_backend(m.backend)
    reasons = [f"{f.requested}->{f.used}: {f.reason}" for f in m.fallbacks]
    at_load = [f"{f.requested}->{f.used}: {f.reason} (at load)" for f in ctx.load_fallbacks()]
    common = {
        "attention_backend": m.backend,
        "requested_backend": m.requested_backend,
        "fallback": bool(reasons or at_load),
        "fallback_reason": "; ".join(at_load + reasons) or None,
        "temperature": batch[0].job.temperature,
        "compute_ms": round(compute_ms, 3),
        **weights_info(m.weights),
    }
    options = batch[0].prepared.options
    head = None
    if "hidden" in options.outputs.outputs:  # how the trainer turns the rows into logits
        head = dict(ctx.scorer.info.get("head") or {})
        head["temperature"] = batch[0].prepared.temperature
        common["head"] = head
    layout = result_layout(options, int(head["hidden_size"]) if head else 0)
    replies: list[Reply] = []
    i = 0
    for p in batch:
        scores = out.scores[i : i + len(p.prepared)]
        i += len(p.prepared)
        queue_ms = round(max(p.read_at_s * 1000.0 - p.entry.enqueued_ms, 0.0), 3)
        shared = sum(s.shared_tokens for s in scores)  # tokens computed once for several
        info = ctx.info(queue_ms=queue_ms, shared_tokens=shared, **common)
        if p.job.images is not None and isinstance(info.get("vision"), dict):  # options used
            used = {**info["vision"].get("options", {}), **dict(p.job.images.processor)}
            info["vision"] = {**info["vision"], "options": used}
        bad = [(k, s.error) for k, s in enumerate(scores) if s.error is not None]
        if bad:
            k, err = bad[0]
            msg = f"seqs[{k}]: {err.message}"
            res = error_result(p.job.id, err.code, msg, meta=p.job.meta, info=info)
        else:
            # numpy float32 arrays: encode_result packs any float32 array-like as it is
            seq_results = [
                SeqResult(logps=cast(Any, s.logps), reward=s.reward,
                          token_scores=cast(Any, s.token_scores), arrays=s.arrays,
                          rm_tokens=s.rm_tokens, rewards=s.rewards,  # reward inputs and heads
                          step_positions=s.step_positions, step_scores=s.step_scores)
                for s in scores
            ]  # fmt: skip
            steps = sum(len(s.step_scores) for s in scores if s.step_scores is not None)
            if steps:
                ctx.metrics.step_scores.inc(steps)
            res = Result(id=p.job.id, ok=True, seqs=seq_results, meta=p.job.meta, info=info)
            res.layout = layout  # teacher outputs: the arrays each seqs entry carries
            if any(s.student is not None for s in p.job.seqs):  # and the aligned spans
                res.layout = {**(layout or {}), **STUDENT_ARRAYS}
            ctx.metrics.result_bytes.observe(array_bytes(scores, res.layout))
        replies.append(Reply(p.entry, p.job.reply_to, res, p.read_at_s))
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
    return replies


def result_layout(options: ScoreOptions, hidden_size: int = 0) -> dict[str, tuple[str, int]] | None:
    """The teacher arrays a result carries besides ``logps`` (None: none, an old result);
    ``hidden`` rows are ``hidden_size`` wide."""
    layout = array_layout(options.outputs, hidden_size)
    layout.pop("logps", None)
    return layout or None


def array_bytes(scores: list[SequenceScore], layout: dict[str, tuple[str, int]] | None) -> int:
    """Wire bytes of the per-token arrays of one job's scores (logps float32, then ``layout``)."""
    total = 0
    for s in scores:
        total += 4 * len(s.logps) if s.logps is not None else 0
        for name, (dtype, _) in (layout or {}).items():
            total += int((s.arrays or {})[name].size) * ARRAY_DTYPES[dtype]
    return total


def fail(ctx: JobContext, batch: list[Pending], code: str, message: str) -> list[Reply]:
    """The same error result for every job of ``batch``."""
    replies = []
    for p in batch:
        info = ctx.info(temperature=p.job.temperature)
        res = error_result(p.job.id, code, message, meta=p.job.meta, info=info)
        replies.append(Reply(p.entry, p.job.reply_to, res, p.read_at_s))
    return replies
