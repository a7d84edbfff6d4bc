"""``scoring-worker enqueue``: score a JSONL file of rollouts through the queue.

Input, one rollout per line: ``{"tokens": [...], "prompt_len": 12}`` or ``{"tokens": [...],
"mask": [0, 0, 1, ...]}``, optional ``id`` (default: ``line-<n>``), ``meta``, ``mode``,
``temperature``, ``adapter``, ``version``, ``step`` (a process-reward step map, else
``--step``); ``{"messages": [{"role": ..., "content": ...}]}`` for a reward on the reward model's
own chat template; ``gather_ids`` ``[n_scored, K]`` on a sequence for per-position gather ids;
or ``{"seqs": [{...}, ...], ...}`` for a multi-sequence job; ``images``: base64 strings of the
job's encoded image files (PNG, JPEG, WebP), ``processor`` its size options, and ``images`` on
a sequence of ``seqs`` the indices of those it shows (a one-sequence line shows them all, in
order; vision-language models); ``student`` (a map: ``prompt`` or ``messages``, and ``tokens``
or ``completion`` with ``offsets``) instead of ``tokens`` for student text that a teacher with
its own tokenizer scores (mode ``reference`` unless the line says otherwise);
``max_result_bytes``, the job's own limit on its result (else ``--max-result-bytes``). Teacher
outputs for every line come from ``--outputs``/``--topk``/``--gather-ids``/``--sampling-*``/
``--float16``/``--hidden-dtype``.
Output, one line per input line as results complete: ``{"id", "ok": true, "logps": [...],
"reward", "meta", "info"}`` plus every array the job produced as a list (``entropy``,
``topk_ids`` ``[[...]]``, ``topk_logps``, ``topk_tail_logp``, ``gather_logps``,
``processed_logps``, ``hidden`` ``[[H] * n]`` with ``hidden_dtype``, a student line's
``span_logps``, ``span_student``, ``span_teacher``, ``teacher_ids``, ``teacher_spans``,
``rewards``, ``step_positions``, ``step_scores``; ``"seqs": [...]`` for
multi-sequence jobs) or ``{"id", "ok": false, "error": {"code", "message"}}``. Ids already in
the output file are skipped, so re-running resumes. When Redis refuses a job for memory
(``QueueFullError``: a full server under ``noeviction``) the run stops there, says how many
jobs it wrote and exits 3; re-running the same command once Redis has room resumes from the
first line not in the output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from worker.client import (
    JobFailed,
    JobSpec,
    QueueFullError,
    ScoreResult,
    ScoringClient,
    ScoringTimeout,
    UnknownQueueError,
    normalize_seqs,
)
from worker.client.images import images_from_base64
from worker.commands._options import add_queue_args, add_redis_args, redis_settings
from worker.config import env_get
from worker.errors import ScoringError
from worker.modes import MODES
from worker.protocol.rewards import decode_step
from worker.request import HIDDEN_DTYPES


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the enqueue flags."""
    add_redis_args(parser)
    add_queue_args(parser, group=False)
    parser.add_argument("--file", required=True, help="input JSONL ('-' = stdin)")
    parser.add_argument("--out", required=True, help="output JSONL (appended; resumable)")
    parser.add_argument(
        "--mode",
        default=env_get("MODE", "reference"),
        choices=MODES,
        help="default mode for lines without one (env SCORING_MODE)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="default temperature for lines without one: log-probs of softmax(logits / T)",
    )
    parser.add_argument(
        "--adapter", help="LoRA adapter (under the workers' --adapter-root) for lines without one"
    )
    parser.add_argument(
        "--version", help="checkpoint (under the workers' --model-root) for lines without one"
    )
    teacher = parser.add_argument_group("teacher outputs (docs/distillation.md), every line")
    teacher.add_argument(
        "--outputs",
        type=_names,
        help="comma-separated: logps,entropy,topk,gather,processed_logps,rank,hidden",
    )
    teacher.add_argument("--topk", type=int, help="k for the topk output")
    teacher.add_argument(
        "--gather-ids", type=_ids, help="comma-separated token ids gathered at every position"
    )
    teacher.add_argument("--sampling-top-k", type=int, help="processed_logps: the sampler's top_k")
    teacher.add_argument("--sampling-top-p", type=float, help="processed_logps: top_p")
    teacher.add_argument("--sampling-min-p", type=float, help="processed_logps: min_p")
    teacher.add_argument(
        "--float16", action="store_true", help="topk_logps/gather_logps travel as float16"
    )
    teacher.add_argument(
        "--hidden-dtype",
        choices=HIDDEN_DTYPES,
        help="of the hidden rows (with --outputs ...,hidden; default bfloat16)",
    )
    teacher.add_argument(
        "--max-result-bytes",
        type=int,
        help="each job's own limit on its result's arrays (too_large over it) for lines without "
        "one; the workers' --max-result-bytes applies too",
    )
    parser.add_argument(
        "--step",
        type=_step,
        help="process rewards: the step map for lines without one, JSON ('{\"tag_id\": 12}')",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=int(env_get("MAX_IN_FLIGHT", "64") or 64),
        help="jobs submitted and not yet answered (backpressure; env SCORING_MAX_IN_FLIGHT; "
        "default 64)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds to wait for each job's result after submitting it",
    )
    parser.add_argument(
        "--retry-errors",
        action="store_true",
        help="on resume, run again the ids whose earlier output line is an error (that line "
        "is replaced: one line per id)",
    )
    parser.add_argument(
        "--wait-for-workers",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="on a queue no worker has served yet (no consumer group), wait this long for one "
        "before submitting (default 0: refuse such a queue at once, exit 2, nothing written; a "
        "queue with a group always waits, within --timeout)",
    )
    parser.add_argument("--ordered", action="store_true", help="write results in input order")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"token ids must be integers: {exc}") from exc


def _step(text: str) -> dict[str, Any]:
    try:
        step = json.loads(text)
        decode_step(step)
    except (ValueError, ScoringError) as exc:
        raise argparse.ArgumentTypeError(f"--step: {exc}") from exc
    return step


def _sampling(args: argparse.Namespace) -> dict[str, Any] | None:
    """``{top_k, top_p, min_p}`` from the ``--sampling-*`` flags given (None: none given)."""
    given = {
        "top_k": args.sampling_top_k,
        "top_p": args.sampling_top_p,
        "min_p": args.sampling_min_p,
    }
    given = {k: v for k, v in given.items() if v is not None}
    return given or None


@dataclass
class Earlier:
    """What an earlier run left in the output file: the ids it scored and the ids it failed
    (error lines; with ``--retry-errors`` their lines were removed and they run again)."""

    scored: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)

    @property
    def done(self) -> set[str]:
        """Ids not to submit again."""
        return self.scored | self.failed


def _earlier(path: str, retry_errors: bool) -> Earlier:
    """Read ``path`` (a torn last line left by a crash is dropped: that job runs again). With
    ``retry_errors`` the file is rewritten without its error lines (atomically: a crash leaves
    the old file or the new one), so each id keeps one line."""
    earlier = Earlier()
    if path == "-" or not os.path.exists(path):
        return earlier
    with open(path, "rb") as fh:
        data = fh.read()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]  # a torn write: redo that job
    kept: list[bytes] = []
    for line in data.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            kept.append(line)
            continue
        if not isinstance(obj, dict) or "id" not in obj:
            kept.append(line)
            continue
        job_id = str(obj["id"])
        if obj.get("ok"):
            earlier.scored.add(job_id)
            kept.append(line)
        elif not retry_errors:
            earlier.failed.add(job_id)
            kept.append(line)
    earlier.failed -= earlier.scored  # an id scored once is scored
    rewritten = b"".join(line + b"\n" for line in kept)
    if rewritten != data or len(data) != os.path.getsize(path):
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(rewritten)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    return earlier


def _read_jobs(
    fh: IO[str],
    done: set[str],
    errors_out: list[dict[str, Any]],
    weights: tuple[str | None, str | None] = (None, None),
) -> Iterator[JobSpec]:
    for n, line in enumerate(fh, start=1):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            errors_out.append({"line": n, "message": f"not JSON: {exc}"})
            continue
        if not isinstance(obj, dict):
            errors_out.append({"line": n, "message": "a line must be a JSON object"})
            continue
        job_id = str(obj.get("id", f"line-{n}"))
        if job_id in done:
            continue
        done.add(job_id)
        multi = "seqs" in obj
        try:
            images = images_from_base64(obj["images"]) if "images" in obj else None
            one = {**obj, "images": list(range(len(images)))} if images else obj  # shows them all
            seqs = normalize_seqs(obj["seqs"] if multi else [one])
            decode_step(obj.get("step"))  # a bad step map is this line's error, not the run's
        except (ScoringError, KeyError, TypeError) as exc:
            errors_out.append({"line": n, "message": f"id {job_id}: {exc}"})
            continue
        student = any(s.student is not None for s in seqs)  # scored in mode reference
        yield JobSpec(
            seqs=seqs,
            mode=obj.get("mode") or ("reference" if student else None),
            temperature=obj.get("temperature"),
            meta={"line": n, "multi": multi, "meta": obj.get("meta")},
            job_id=job_id,
            adapter=obj.get("adapter", weights[0]),  # per-job weights: the line's, else --adapter
            version=obj.get("version", weights[1]),
            step=obj.get("step"),  # None: --step (score_many's default)
            images=images,
            processor=obj.get("processor"),
            max_result_bytes=obj.get("max_result_bytes"),  # None: --max-result-bytes
        )


def _count_lines(path: str) -> int | None:
    if path == "-":
        return None
    with open(path, "rb") as fh:
        return sum(1 for line in fh if line.strip())


def _progress(total: int | None, disable: bool) -> Any:
    if disable or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="job", file=sys.stderr, dynamic_ncols=True)


def _line(item: ScoreResult | JobFailed) -> dict[str, Any]:
    wrapped = item.meta if isinstance(item.meta, dict) else {}
    out: dict[str, Any] = {"id": item.job_id}
    if isinstance(item, JobFailed):
        out["ok"] = False
        out["error"] = {"code": item.code, "message": item.reason}
    else:
        out["ok"] = True
        if wrapped.get("multi"):
            out["seqs"] = [s.to_json() for s in item.seqs]
        else:
            out.update(item.seqs[0].to_json())
        out["info"] = item.info
    if wrapped.get("meta") is not None:
        out["meta"] = wrapped["meta"]
    return out


def _wait_for_queue(client: ScoringClient, wait_s: float) -> None:
    """Wait up to ``wait_s`` for a queue no worker has served yet to be served (a live worker
    or a consumer group); the first submit then applies the queue rule."""
    deadline = time.monotonic() + wait_s
    while client.queue_state().known is False and time.monotonic() < deadline:
        time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))


def run(args: argparse.Namespace) -> int:
    """Score every line of ``--file`` not yet in ``--out``. Exit 0 when every line of the output
    is a result; 1 when any is an error (earlier ones included) or a line could not be read; 3
    when Redis refused a job for memory (the run stopped there; re-run to resume); 2
    when the queue is unknown (no worker serves it and none ever did; ``--wait-for-workers``
    waits that long for one first). A queue with a consumer group waits for a worker within
    ``--timeout`` (scale from zero)."""
    if args.hidden_dtype and "hidden" not in (args.outputs or ()):
        print("error: --hidden-dtype needs --outputs ...,hidden", file=sys.stderr)
        return 2
    if args.max_result_bytes is not None and args.max_result_bytes < 1:
        print("error: --max-result-bytes must be a positive number of bytes", file=sys.stderr)
        return 2
    earlier = _earlier(args.out, args.retry_errors)
    done = earlier.done
    total = _count_lines(args.file)
    bar = None
    bad_lines: list[dict[str, Any]] = []
    ok = failed = 0
    full: QueueFullError | None = None
    settings = redis_settings(args)
    client = ScoringClient.from_settings(
        settings, queue=args.queue, partitions=args.partitions, mode=args.mode
    )
    try:
        if args.wait_for_workers > 0:
            _wait_for_queue(client, args.wait_for_workers)
        bar = _progress(None if total is None else max(total - len(done), 0), args.no_progress)
        src = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")  # noqa: SIM115
        with src, open(args.out, "a", encoding="utf-8") as out:
            results = client.score_many(
                _read_jobs(src, done, bad_lines, (args.adapter, args.version)),
                max_in_flight=args.max_in_flight,
                ordered=args.ordered,
                timeout=args.timeout,
                temperature=args.temperature,
                raise_errors=False,
                outputs=args.outputs,
                topk=args.topk,
                gather_ids=args.gather_ids,
                sampling=_sampling(args),
                float16=args.float16 or None,
                hidden_dtype=args.hidden_dtype,
                max_result_bytes=args.max_result_bytes,
                step=args.step,
            )
            for item in results:
                if isinstance(item, JobFailed):
                    failed += 1
                else:
                    ok += 1
                out.write(json.dumps(_line(item)) + "\n")
                out.flush()
                if bar is not None:
                    bar.update(1)
    except UnknownQueueError as exc:  # refused at the first submit: nothing was written
        waited = f" (waited {args.wait_for_workers:g} s)" if args.wait_for_workers else ""
        print(f"error: {exc} on {settings.redacted_url}{waited}", file=sys.stderr)
        print(f"  {exc.hint}", file=sys.stderr)
        return 2
    except QueueFullError as exc:  # Redis is full: stop here; the summary says what went in
        full = exc
    except ScoringTimeout as exc:
        print(f"error: {exc}; re-run the same command to resume", file=sys.stderr)
        return 1
    except ScoringError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
        if bar is not None:
            with contextlib.suppress(Exception):
                bar.close()
    for bad in bad_lines:
        print(f"skipped line {bad['line']}: {bad['message']}", file=sys.stderr)
    if full is not None:
        _report_full(full, settings.redacted_url, args.out)
    errors = failed + len(earlier.failed)
    summary = f"{ok} scored, {failed} failed"
    if earlier.done:
        summary += f"; earlier runs: {len(earlier.scored)} scored, {len(earlier.failed)} failed"
    summary += f"; {len(bad_lines)} unreadable -> {args.out}"
    print(summary, file=sys.stderr)
    if earlier.failed:
        print(f"  {len(earlier.failed)} earlier error lines kept in {args.out}; "
              "--retry-errors runs them again", file=sys.stderr)  # fmt: skip
    if full is not None:
        return FULL_EXIT
    return 0 if not errors and not bad_lines else 1


#: Exit code of a run stopped by a full Redis (re-run the same command once it has room).
FULL_EXIT = 3


def _report_full(exc: QueueFullError, url: str, out: str) -> None:
    """What a run stopped by a full Redis wrote, and how to go on."""
    wrapped = exc.meta if isinstance(exc.meta, dict) else {}
    line = f" (line {wrapped['line']})" if "line" in wrapped else ""
    print(
        f"error: Redis at {url} is full: it refused job {exc.job_id}{line} for memory, nothing "
        f"of it was written; this run wrote {exc.written} jobs before it, "
        f"{exc.written - len(exc.in_flight)} answered in {out}, {len(exc.in_flight)} in flight "
        f"(the workers score them; their results are not in {out}, so a re-run submits them "
        "again)",
        file=sys.stderr,
    )
    print(
        "  re-run the same command once Redis has room: it resumes from the first line not in "
        f"{out} (docs/operations.md: maxmemory and noeviction)",
        file=sys.stderr,
    )
