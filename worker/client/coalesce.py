"""Many small asyncio calls, few jobs: ``Coalescer`` gathers the sequences of concurrent callers
into multi-sequence jobs on one ``AsyncScoringClient``.

A caller awaits ``score(seqs, key, timeout_s)``. Its sequences are validated at once (a
``BadRequest`` before anything is sent), then join the open batch of its ``BatchKey`` (the job
settings that must be equal within one job: mode, temperature, teacher outputs, weights). A
batch is submitted ``window_s`` after its first caller joined, or as soon as it holds
``max_seqs`` sequences or ``max_tokens`` tokens; a caller never waits for a batch of another
key. When the job's result arrives, every caller of the batch gets its own ``SeqScore`` slice
at once. No thread per caller: each job is one task awaiting one result.

Groups: a caller may name the ``prefix`` its sequences start with (a GRPO group's prompt). When
the batch is submitted, the callers of one prefix go as a job of their own that carries the
prefix once (protocol ``prefix``) when that keeps ``min_saved_ids`` token ids or more off the
wire (``len(prefix) * (sequences - 1)``: two or more sequences, and more ids than a job's own
fields weigh); every other caller (no prefix, a prefix alone or too short) goes in one plain
job, as without groups. Every job of the batch decodes to the same whole sequences: only the
bytes on the wire change.

Images: a caller may pass the images its sequences show (``images``; each sequence's
``images`` indexes the caller's list). A job carries each distinct image file once, however many
of its callers show it (a GRPO group's prompt image, passed by each sample, goes once), and each
sequence's indices are renumbered into the job's list (``worker.client.images.merge_images``).

Failures: a job that comes back ``bad_request`` or ``too_long`` while it carried several
callers is split, each caller's sequences submitted again as a job of its own, so one bad input
fails only its own caller. Any other error result (``model_not_found``, ``expired``, ...) goes
to every caller of the batch. A caller past its deadline gets ``ScoringTimeout`` (the batch
waits as long as its latest caller; a job none still waits for is forgotten). A job whose worker
dies mid-batch is taken over by another worker (the consumer group's reclaim); with
``resubmit_after_s`` on the client, a job lost with a Redis failover is added again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker import protocol
from worker.client.aio import AsyncScoringClient
from worker.client.errors import ScoringTimeout, job_failed
from worker.client.images import caller_images, merge_images
from worker.client.inputs import normalize_seqs
from worker.client.results import ScoreResult, SeqScore

log = logging.getLogger(__name__)

#: Jobs being added (``XADD``) at once, at most: each holds a Redis connection meanwhile.
MAX_CONCURRENT_SUBMITS = 16
#: Token ids a prefix job keeps off the wire, at least (``Coalescer``): 192 bytes, more than a
#: job's own fields weigh (id, reply stream, mode, temperature, deadline: 170 bytes on queue
#: ``default``, 2026-12-04, ``len(encode_job(...))`` of one sequence less its second one's).
MIN_SAVED_IDS = 48
#: Error codes after which a batch of several callers is split and each resubmitted alone.
SPLIT_CODES = frozenset({"bad_request", "too_long"})


@dataclass(frozen=True)
class BatchKey:
    """What the sequences of one job share (callers with equal keys may share a job)."""

    mode: str = "reference"
    temperature: float = 1.0
    outputs: tuple[str, ...] | None = None
    topk: int | None = None
    adapter: str | None = None
    version: str | None = None
    gather_width: int | None = None  # K of per-sequence gather ids (a job holds one K)
    processor: tuple[tuple[str, int], ...] = ()  # the job's image-processor options, by name


@dataclass
class _Caller:
    seqs: list[protocol.SeqSpec]
    future: asyncio.Future[list[SeqScore]]
    deadline: float  # monotonic
    prefix: array | None = None  # token ids every one of ``seqs`` starts with (a group's prompt)
    images: tuple[bytes, ...] = ()  # encoded image files ``seqs``' ``images`` index

    @property
    def tokens(self) -> int:
        return sum(max(len(s.tokens), 1) for s in self.seqs)


@dataclass
class _Batch:
    callers: list[_Caller] = field(default_factory=list)
    seqs: int = 0
    tokens: int = 0
    timer: asyncio.TimerHandle | None = None


class Coalescer:
    """Coalesces concurrent ``score`` calls into jobs on ``client`` (see the module docstring).

    ``window_s``: how long a batch stays open after its first caller (0: submit at the next
    turn of the event loop, still gathering what arrived meanwhile); ``max_seqs`` /
    ``max_tokens``: a batch is submitted when it reaches either (a caller larger than that goes
    alone); ``min_saved_ids``: the fewest ids a prefix job must keep off the wire (module
    docstring). Counters: ``jobs`` submitted, ``splits`` (failed batches split per caller);
    ``on_job`` is called once per job submitted (a metric's ``inc``).
    """

    def __init__(
        self,
        client: AsyncScoringClient,
        *,
        window_s: float = 0.005,
        max_seqs: int = 256,
        max_tokens: int = 1 << 20,
        min_saved_ids: int = MIN_SAVED_IDS,
        on_job: Callable[[], object] | None = None,
    ) -> None:
        if window_s < 0 or max_seqs < 1 or max_tokens < 1:
            raise ValueError("window_s must be >= 0, max_seqs and max_tokens >= 1")
        self.client = client
        self.window_s = window_s
        self.max_seqs = max_seqs
        self.max_tokens = max_tokens
        self.min_saved_ids = min_saved_ids
        self._open: dict[BatchKey, _Batch] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._submits: asyncio.Semaphore | None = None  # made in the loop, on first use
        self.jobs = 0
        self.splits = 0
        self._on_job = on_job

    @property
    def in_flight(self) -> int:
        """Jobs submitted (or being submitted) whose result has not been handed out yet."""
        return len(self._tasks)

    async def score(
        self,
        seqs: Any,
        key: BatchKey,
        timeout_s: float,
        *,
        prefix: Any = None,
        images: Any = None,
    ) -> list[SeqScore]:
        """The scores of ``seqs`` (one ``SeqScore`` each, in order), scored in some batch of
        ``key``. With ``prefix`` (token ids), each of ``seqs`` is what follows it, as in
        ``AsyncScoringClient.score`` (``prompt_len`` defaults to ``len(prefix)``), and the
        callers of one prefix share a job that carries it once (module docstring). ``images``:
        the images ``seqs`` show (bytes, paths or PIL images, as ``AsyncScoringClient.score``
        takes), each sequence's ``images`` indexing this list. Raises
        ``BadRequest`` for invalid input (nothing sent), the job's ``JobFailed``, or
        ``ScoringTimeout`` after ``timeout_s``."""
        specs = normalize_seqs(seqs, prefix)  # whole sequences
        head = None if prefix is None else protocol.as_int32_array(prefix)
        files = caller_images(specs, images)
        loop = asyncio.get_running_loop()
        caller = _Caller(specs, loop.create_future(), time.monotonic() + timeout_s, head, files)
        self._join(key, caller)
        try:
            return await asyncio.wait_for(asyncio.shield(caller.future), timeout_s)
        except TimeoutError:
            raise await self.client.timeout_error("(coalesced)", timeout_s) from None
        finally:
            caller.future.cancel()  # no-op once answered; a late answer is then dropped

    def _join(self, key: BatchKey, caller: _Caller) -> None:
        batch = self._open.get(key)
        if batch is not None and (
            batch.seqs + len(caller.seqs) > self.max_seqs
            or batch.tokens + caller.tokens > self.max_tokens
        ):
            self._flush(key)
            batch = None
        if batch is None:
            batch = self._open[key] = _Batch()
            loop = asyncio.get_running_loop()
            batch.timer = loop.call_later(self.window_s, self._flush, key)
        batch.callers.append(caller)
        batch.seqs += len(caller.seqs)
        batch.tokens += caller.tokens
        if batch.seqs >= self.max_seqs or batch.tokens >= self.max_tokens:
            self._flush(key)

    def _flush(self, key: BatchKey) -> None:
        batch = self._open.pop(key, None)
        if batch is None:
            return
        if batch.timer is not None:
            batch.timer.cancel()
        self._start(key, batch.callers)

    def _start(self, key: BatchKey, callers: list[_Caller]) -> None:
        """One task per job of ``callers`` (``jobs_of``)."""
        for head, part in jobs_of(callers, self.min_saved_ids):
            task = asyncio.get_running_loop().create_task(self._run(key, part, head))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, key: BatchKey, callers: list[_Caller], head: array | None) -> None:
        """Submit one job for ``callers`` (carrying ``head`` once as its ``prefix``, when
        given) and hand each its scores (or its error)."""
        callers = [c for c in callers if not c.future.done()]
        if not callers:
            return
        seqs, files = merge_images([(c.seqs, c.images) for c in callers])
        wait_s = max(c.deadline for c in callers) - time.monotonic()
        handle = None
        if self._submits is None:
            self._submits = asyncio.Semaphore(MAX_CONCURRENT_SUBMITS)
        try:
            async with self._submits:  # a bounded number of XADDs (connections) at once
                handle = await self.client.submit(
                    seqs,
                    key.mode,
                    key.temperature,
                    expires_in_s=max(wait_s, 0.001),
                    outputs=key.outputs,
                    topk=key.topk,
                    adapter=key.adapter,
                    version=key.version,
                    prefix=head,
                    images=files or None,
                    processor=dict(key.processor) if files else None,
                )
            self.jobs += 1
            if self._on_job is not None:
                self._on_job()
            raw = await self.client.raw_result(handle, timeout=max(wait_s, 0.001))
        except ScoringTimeout as exc:
            if handle is not None:
                self.client.forget(handle)
            _fail(callers, exc)
            return
        except Exception as exc:  # Redis away, a closed client: every caller learns it
            _fail(callers, exc)
            return
        if raw.ok:
            _deliver(callers, ScoreResult.from_wire(raw))
            return
        failed = job_failed(raw)
        if len(callers) > 1 and failed.code in SPLIT_CODES:
            self.splits += 1
            log.debug(
                "job %s failed [%s] for %d callers: each alone", raw.id, failed.code, len(callers)
            )
            for caller in callers:
                self._start(key, [caller])
            return
        _fail(callers, failed)

    async def close(self) -> None:
        """Submit what is open and wait for the jobs in flight (their callers are answered)."""
        for key in list(self._open):
            self._flush(key)
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def jobs_of(
    callers: Sequence[_Caller], min_saved_ids: int = 1
) -> list[tuple[array | None, list[_Caller]]]:
    """The jobs ``callers`` go in, as ``(prefix, callers)``: one per prefix whose callers hold
    ``n`` sequences between them with ``len(prefix) * (n - 1) >= min_saved_ids`` (and
    ``n >= 2``), then one plain job (``None``) for the rest, each in the callers' order."""
    held: dict[bytes, int] = {}  # sequences per prefix
    for c in callers:
        if c.prefix is not None:
            held[c.prefix.tobytes()] = held.get(c.prefix.tobytes(), 0) + len(c.seqs)

    def grouped(head: array) -> bool:
        n = held[head.tobytes()]
        return n >= 2 and len(head) * (n - 1) >= min_saved_ids

    groups: dict[bytes, list[_Caller]] = {}
    plain: list[_Caller] = []
    for c in callers:
        if c.prefix is not None and grouped(c.prefix):
            groups.setdefault(c.prefix.tobytes(), []).append(c)
        else:
            plain.append(c)
    out: list[tuple[array | None, list[_Caller]]] = [(g[0].prefix, g) for g in groups.values()]
    if plain:
        out.append((None, plain))
    return out


def _deliver(callers: Sequence[_Caller], result: ScoreResult) -> None:
    at = 0
    for caller in callers:
        n = len(caller.seqs)
        if not caller.future.done():
            caller.future.set_result(result.seqs[at : at + n])
        at += n


def _fail(callers: Sequence[_Caller], exc: BaseException) -> None:
    for caller in callers:
        if not caller.future.done():
            caller.future.set_exception(exc)


__all__ = ["MIN_SAVED_IDS", "SPLIT_CODES", "BatchKey", "Coalescer", "jobs_of"]
