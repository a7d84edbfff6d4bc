"""Running planned batches: attention-backend fallback, halving on device OOM, the KV guard.

``BatchRunner.run_group`` runs one planned batch of a ``ScoreCall`` and writes its results into
that call. A batch runs on the active backend; an error raised inside an attention kernel
retries it on the next backend(s) of the chain (the models switch for that batch only, and the
fallback is reported); a device OOM splits the batch in halves, and a sequence that does not
fit even alone gets ``TooLong``. Every forward runs inside a ``KVGuard`` scope: a returned cache
rejects the batch (``KVCacheRejected``) or, in warn mode, is dropped and counted.

Threads: forwards on the active backend run concurrently; switching the models' backend for a
fallback holds ``BackendGate`` alone (the switch rewrites model configs that every forward
reads), so no forward runs while the models are on a fallback backend.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace

import torch

from worker.errors import (
    AttentionBackendError,
    InternalError,
    KVCacheRejected,
    ScoringError,
    TooLong,
)
from worker.executor import backends
from worker.executor.call import BatchResult, CallPlan, ScoreCall
from worker.executor.config import ExecutorConfig, Layout
from worker.executor.forward import BatchForward
from worker.executor.kvcache import KVGuard
from worker.executor.memory import free_device_memory
from worker.executor.tree.check import kernel_for
from worker.executor.tree.trie import (
    SharedGroup,
    leftover,
    plan_trees,
    shared_groups,
    tree_tokens,
)
from worker.executor.vision.layout import ImageLayouts, image_share_groups
from worker.modes import Mode
from worker.scorer.inputs import PreparedSequence
from worker.scorer.outputs import FallbackEvent, SequenceScore

log = logging.getLogger(__name__)


class BackendGate:
    """Readers-writer gate over the models' attention backend.

    ``shared()``: a forward on the active backend (any number at once). ``exclusive()``: a
    temporary backend switch (alone; waiting switches hold back new forwards so they are not
    starved).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Hold the gate together with other forwards."""
        with self._cond:
            self._cond.wait_for(lambda: not self._writing and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the gate alone."""
        with self._cond:
            self._writers_waiting += 1
            self._cond.wait_for(lambda: not self._writing and self._readers == 0)
            self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


@dataclass(frozen=True)
class TreeForward:
    """One forward of tree rows: each row a shared prefix and its continuations (``rows``'
    members index the call's sequences)."""

    rows: tuple[SharedGroup, ...]

    @property
    def members(self) -> list[int]:
        """The call's sequences this forward scores, row by row."""
        return [i for row in self.rows for i in row.members]


Forward = list[int] | TreeForward


def layouts_for(vision: ImageLayouts, reward: ImageLayouts | None, mode: Mode) -> ImageLayouts:
    """The layouts image sequences of a ``mode`` call run in: the reward model's (``reward``)
    for a ``reward`` call when it has its own, else the reference model's (``vision``)."""
    return reward if mode == "reward" and reward is not None else vision


class BatchRunner:
    """Runs the batches of ``score`` calls on ``forward`` (see the module docstring).

    ``backend``: the backend active between calls; ``packed``/``unmasked``: whether those batch
    layouts may run (settled at load by the probe); ``layout(backend)`` picks one per backend.
    ``notify(event)`` is called on every run-time fallback. ``share_min``: the shortest prefix
    that tree rows share (``tree``); 0 turns sharing off.
    """

    def __init__(
        self,
        config: ExecutorConfig,
        forward: BatchForward,
        guard: KVGuard,
        *,
        backend: str,
        packed: bool,
        unmasked: bool = False,
        notify: Callable[[FallbackEvent], None],
        share_min: int = 0,
    ) -> None:
        self.config = config
        self.forward = forward
        self.guard = guard
        self.backend = backend
        self.packed = packed
        self.unmasked = unmasked
        self._notify = notify
        self._gate = BackendGate()
        self.share_min = share_min
        self.vision = ImageLayouts()  # image sequences: padded only until the image check
        self.reward_vision: ImageLayouts | None = None  # a reward call's (None: ``vision``)

    def layout(self, backend: str | None = None) -> Layout:
        """The batch layout on ``backend`` (default: the active one), ``backends.layout_for``."""
        return backends.layout_for(
            backend or self.backend, packed=self.packed, unmasked=self.unmasked
        )

    def plan(self, call: ScoreCall) -> list[Forward]:
        """``call``'s forwards: tree rows for the sequences sharing prefixes of at least
        ``share_min`` tokens (when sharing is on), the rest in the layout of the active
        backend."""
        trees: list[Forward] = []
        rest: list[int] | None = None
        groups = self._groups(call.prepared, call.mode)
        if groups:
            forwards = plan_trees(groups, call.lengths, self.config.max_batch_tokens)
            trees = [TreeForward(tuple(rows)) for rows in forwards]
            rest = leftover(len(call.prepared), forwards) if trees else None
        return trees + list(self._plan_layout(call, rest))

    def _groups(self, seqs: Sequence[PreparedSequence], mode: Mode) -> list[SharedGroup]:
        """The prefix trees of ``seqs`` (none when sharing is off, or for the image sequences of
        a ``mode`` call not served in tree rows); images compared by content (``share_keys``)."""
        if not self.share_min or len(seqs) < 2:
            return []
        if not any(s.vision is not None for s in seqs):
            return shared_groups([s.ids for s in seqs], self.share_min)
        layouts = layouts_for(self.vision, self.reward_vision, mode)
        if not layouts.tree:
            return []
        return image_share_groups(seqs, self.share_min, layouts.image_token)

    def cost(self, plan: Sequence[CallPlan]) -> int | None:
        """Tokens a request's ``plan`` takes through the backbone when its one call's sequences
        share prefixes (each shared node once, ``trie.shared_groups``), or ``None`` when sharing
        is off, the plan has two calls or nothing is shared: what the request counts for in a
        batch's token budget."""
        seqs = plan[0].seqs if len(plan) == 1 else ()
        groups = self._groups(seqs, plan[0].mode)
        return tree_tokens(groups, [len(s.ids) for s in seqs]) if groups else None

    def _plan_layout(self, call: ScoreCall, subset: list[int] | None) -> list[list[int]]:
        """``call``'s forwards (of ``subset``, default all) in the active backend's layout;
        image sequences in packed rows only where the image check allowed them, else padded."""
        if subset is not None and not subset:
            return []
        among = range(len(call.prepared)) if subset is None else subset
        return call.plan(
            self.config,
            layout=self._allowed(self.layout(), [call.prepared[i] for i in among], call.mode),
            backend=self.backend,
            pad_fraction=self.config.pad_fraction(self.forward.device.type),
            subset=subset,
        )

    def _allowed(self, layout: Layout, seqs: Sequence[PreparedSequence], mode: Mode) -> Layout:
        """``layout`` for ``seqs`` of a ``mode`` call; with image sequences among them, masked
        padded buckets unless the image check allowed ``layout`` for them (``layouts_for``)."""
        allowed = getattr(layouts_for(self.vision, self.reward_vision, mode), layout, False)
        return "padded" if not allowed and any(s.vision is not None for s in seqs) else layout

    def run_group(self, group: Forward, call: ScoreCall) -> None:
        """Run one planned batch into ``call``; on device OOM split it in halves.

        The OOM is only recorded inside the ``except``; the recovery runs after it. While the
        exception is bound, its traceback keeps every frame of the failed forward alive, and with
        them its hidden states, q/k/v and masks: halves run there would find that memory still
        taken and split far more often than needed (PyTorch FAQ, "My out of memory exception
        handler can't allocate memory"). Leaving the block drops the traceback; the device cache
        is freed, then the halves run. A ``TreeForward`` runs in ``_run_tree``.
        """
        if isinstance(group, TreeForward):
            self._run_tree(group, call)
            return
        try:
            call.add(group, self._run_with_fallback(group, call))
            return
        except torch.OutOfMemoryError as exc:
            message = str(exc)  # a string only: nothing that reaches the failed frames
        self._recover(group, call, message)

    def _recover(self, group: list[int], call: ScoreCall, message: str) -> None:
        """After an OOM on ``group`` (outside its ``except``): free the device cache, then split
        the batch in halves, or mark a lone sequence ``TooLong``."""
        device = self.forward.device
        free_device_memory(device)
        if len(group) == 1:
            n = len(call.prepared[group[0]].ids)
            log.warning("sequence of %d tokens does not fit on %s", n, device)
            error = TooLong(f"sequence of {n} tokens does not fit on {device}: {message}"[:500])
            call.results[group[0]] = SequenceScore(error=error)
            return
        call.oom_splits += 1
        half = len(group) // 2
        log.warning("out of memory on a batch of %d sequences; splitting", len(group))
        self.run_group(group[:half], call)
        self.run_group(group[half:], call)

    def _run_tree(self, tree: TreeForward, call: ScoreCall) -> None:
        """One forward of tree rows; on device OOM split it (between rows, then between a row's
        continuations); any other failure of the tree path scores its sequences in the usual
        layouts (logged), never approximately."""
        members = tree.members
        try:
            call.add(members, self._tree_batch(tree, call))
            return
        except torch.OutOfMemoryError as exc:
            message = str(exc)
        except ScoringError:
            raise
        except Exception as exc:
            log.warning(
                "tree forward failed (%s: %s); scoring its %d sequences one by one",
                type(exc).__name__, exc, len(members),
            )  # fmt: skip
            for group in self._plan_layout(call, members):
                self.run_group(group, call)
            return
        free_device_memory(self.forward.device)
        call.oom_splits += 1
        log.warning("out of memory on a tree forward (%s); splitting", message[:200])
        rows = tree.rows
        if len(rows) > 1:
            half = len(rows) // 2
            parts: list[Forward] = [TreeForward(rows[:half]), TreeForward(rows[half:])]
        else:
            row = rows[0]
            order = row.dfs_order()
            half = len(order) // 2
            parts = []
            for keep in (order[:half], order[half:]):
                sub = row.subset(keep)
                parts.append(TreeForward((sub,)) if sub else [row.members[k] for k in keep])
        for part in parts:
            self.run_group(part, call)

    def _tree_batch(self, tree: TreeForward, call: ScoreCall) -> BatchResult:
        """One tree forward on the active backend, the models held alone (their attention
        switched for it), timed, inside a KV-guard scope."""
        members = tree.members
        local = {i: k for k, i in enumerate(members)}
        rows = [replace(r, members=tuple(local[i] for i in r.members)) for r in tree.rows]
        seqs = [call.prepared[i] for i in members]
        reject = self.config.reject_kv_cache_outputs
        with self._gate.exclusive():
            backend = self.backend
            t0 = time.perf_counter()
            with self.guard.scope(drop=not reject) as kv:
                computed = self.forward.compute_tree(
                    seqs, members, rows, call.mode, call.temperature,
                    kernel=kernel_for(backend), options=call.options, features=call.features,
                )  # fmt: skip
            if self.forward.device.type == "cuda":
                torch.cuda.synchronize(self.forward.device)
            elapsed = time.perf_counter() - t0
        self._check_kv(kv.tensors, kv.nbytes)
        for row in rows:  # each member's shared nodes, computed once for the row
            for k, i in enumerate(row.members):
                computed.scores[i].shared_tokens = row.depth(k)
        unique = tree_tokens(rows, [len(s.ids) for s in seqs])  # every member is in a row
        return BatchResult(
            scores=computed.scores,
            backend=backend,
            packed=False,
            forward_s=elapsed,
            extra_tokens=max(0, computed.slot_tokens - unique),
            kv_tensors=kv.tensors,
            kv_bytes=kv.nbytes,
            forward_tokens=unique,
            shared_tokens=sum(r.shared_tokens for r in rows),
            vision_images=computed.vision_images,
            vision_s=computed.vision_s,
        )

    def _check_kv(self, tensors: int, nbytes: int) -> None:
        """A returned KV cache: ``KVCacheRejected`` (rejection on) or a warning (dropped)."""
        if not tensors:
            return
        if self.config.reject_kv_cache_outputs:
            raise KVCacheRejected(
                f"model returned a KV cache despite use_cache=False "
                f"({tensors} tensors, {nbytes} bytes); batch rejected",
                kv_output_tensors=tensors, kv_output_bytes=nbytes,
            )  # fmt: skip
        log.warning("model returned a KV cache (%d tensors, %d bytes); dropped", tensors, nbytes)

    def _run_with_fallback(self, group: list[int], call: ScoreCall) -> BatchResult:
        """Run a batch; an attention-kernel error retries it on the next backend(s)."""
        failed = self.backend
        with self._gate.shared():
            try:
                return self._run_batch(group, call, failed)
            except (torch.OutOfMemoryError, ScoringError):
                raise
            except Exception as exc:
                errors = [_kernel_failure(exc, failed, first=True)]
        with self._gate.exclusive():
            return self._fall_back(group, call, failed, errors)

    def _fall_back(
        self, group: list[int], call: ScoreCall, failed: str, errors: list[str]
    ) -> BatchResult:
        """Try the backends after ``failed`` in turn, each switched on for this batch only."""
        candidate = backends.next_backend(failed)
        while candidate is not None:
            with ExitStack() as stack:
                try:
                    for model in self.forward.models:
                        stack.enter_context(backends.temporary_backend(model, candidate))
                except Exception as exc:  # switch refused; configs already restored
                    errors.append(f"{candidate}: cannot switch: {exc}"[:300])
                    candidate = backends.next_backend(candidate)
                    continue
                try:
                    result = self._run_batch(group, call, candidate)
                except (torch.OutOfMemoryError, ScoringError):
                    raise
                except Exception as exc:
                    errors.append(_kernel_failure(exc, candidate, first=False))
                    candidate = backends.next_backend(candidate)
                    continue
            event = FallbackEvent(failed, candidate, "kernel_error", "; ".join(errors), "run")
            log.warning(
                "attention backend fallback at run time: %s -> %s (%s)",
                event.requested,
                event.used,
                event.message,
            )
            call.fallbacks.append(event)
            self._notify(event)
            return result
        raise AttentionBackendError(
            "no attention backend could run the batch: " + "; ".join(errors)
        )

    def _run_batch(self, group: list[int], call: ScoreCall, backend: str) -> BatchResult:
        """One forward of ``group`` on ``backend``, timed, inside a KV-guard scope."""
        seqs = [call.prepared[i] for i in group]
        layout = self._allowed(self.layout(backend), seqs, call.mode)
        reject = self.config.reject_kv_cache_outputs
        t0 = time.perf_counter()
        with self.guard.scope(drop=not reject) as kv:
            computed = self.forward.compute(
                seqs,
                group,
                call.mode,
                call.temperature,
                layout=layout,
                row_tokens=self.config.row_tokens(backend),
                options=call.options,
                features=call.features,
            )
        if self.forward.device.type == "cuda":
            torch.cuda.synchronize(self.forward.device)
        elapsed = time.perf_counter() - t0
        self._check_kv(kv.tensors, kv.nbytes)
        return BatchResult(
            scores=computed.scores,
            backend=backend,
            packed=layout == "packed",
            forward_s=elapsed,
            extra_tokens=max(0, computed.slot_tokens - sum(len(s.ids) for s in seqs)),
            kv_tensors=kv.tensors,
            kv_bytes=kv.nbytes,
            forward_tokens=sum(len(s.ids) for s in seqs),
            vision_images=computed.vision_images,
            vision_s=computed.vision_s,
        )


def _kernel_failure(exc: Exception, backend: str, *, first: bool) -> str:
    """What an attention-kernel error on ``backend`` says, for the fallback's message; any other
    error ends the batch as ``InternalError`` (``first``: on the active backend)."""
    if not backends.is_attention_kernel_error(exc):
        where = "" if first else f" on {backend}"
        raise InternalError(f"forward failed{where}: {type(exc).__name__}: {exc}"[:500]) from exc
    return f"{backend}: {type(exc).__name__}: {exc}"[:300]
