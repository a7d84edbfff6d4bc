"""The stateless scoring executor: ragged sequences in, log-probs and/or rewards out.

One ``use_cache=False`` forward per batch under ``torch.inference_mode()``; completion-only,
vocab-chunked log-probs (``logprobs``); reward pooling at each sequence's true last token
(``pooling``); padding-free packing with a padded fallback (``packing``); attention backend
fallback (``backends``); KV-output rejection; CUDA OOM splitting. The contract is written down
in ``docs/executor.md``.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np
import torch
from torch import nn

from worker.errors import (
    AttentionBackendError,
    BadRequest,
    ConfigError,
    InternalError,
    KVCacheRejected,
    ScoringError,
    TooLong,
    UnsupportedMode,
)
from worker.executor import backends
from worker.executor.kvcache import cache_outputs, tensors_in
from worker.executor.loading import load_model, resolve_device, resolve_dtype
from worker.executor.logprobs import chunked_token_logps, logit_transform_for, naive_token_logps
from worker.executor.memory import (
    device_total_bytes,
    free_device_memory,
    read_peak,
    reset_peak,
)
from worker.executor.packing import (
    ForwardBatch,
    gather_flat,
    pack_rows,
    pad,
    plan_packed,
    plan_packed_forwards,
    plan_padded,
)
from worker.executor.pooling import (
    HiddenStateRewardAdapter,
    RewardAdapter,
    RewardOutput,
    SequenceClassificationAdapter,
    backbone_hidden,
    backbone_of,
)
from worker.scorer.inputs import PreparedSequence, SequenceInput, is_int, prepare_sequence
from worker.scorer.outputs import BatchMetrics, FallbackEvent, ScoreOutput, SequenceScore

__all__ = [
    "BatchMetrics",
    "ExecutorConfig",
    "FallbackEvent",
    "Mode",
    "ScoreOutput",
    "SequenceInput",
    "SequenceScore",
    "StatelessExecutor",
]

log = logging.getLogger(__name__)

Mode = Literal["reference", "reward", "both"]
MODES: tuple[str, ...] = get_args(Mode)
_BACKENDS = ("auto", "flash_attention_2", "sdpa", "eager")
_DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass(frozen=True)
class ExecutorConfig:
    """Executor settings; every invalid value raises ``ConfigError`` at construction.

    ``max_batch_tokens`` bounds one forward (a packed row, or ``rows * longest`` of a padded
    bucket); a single sequence longer than it runs alone. ``logprob_chunk_tokens`` is the number
    of scored positions pushed through the LM head at once (peak extra memory is
    ``logprob_chunk_tokens * vocab * 4`` bytes). ``self_check`` runs a tiny probe at construction
    that compares the fast path against the model's own logits and packed rows against
    one-by-one forwards (packing falls back to padded buckets when they disagree).
    ``packed_row_tokens`` caps one packed row for backends that build a dense block-diagonal mask
    (sdpa, eager: attention cost grows with the row length squared); a forward then holds several
    such rows. Flash/flex attention skip the cross-sequence blocks and pack up to the full budget.
    """

    mode: Mode = "reference"
    attention_backend: Literal["auto", "flash_attention_2", "sdpa", "eager"] = "auto"
    reject_kv_cache_outputs: bool = True
    temperature: float = 1.0
    output_dtype: Literal["float32", "float64"] = "float32"
    max_batch_tokens: int = 16384
    logprob_chunk_tokens: int = 1024
    device: str = "cpu"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    packing: Literal["auto", "packed", "padded"] = "auto"
    packed_row_tokens: int = 2048
    self_check: bool = True

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"ExecutorConfig.{name}={getattr(self, name)!r}: {why}")

        if self.mode not in MODES:
            raise bad("mode", f"expected one of {MODES}")
        if self.attention_backend not in _BACKENDS:
            raise bad("attention_backend", f"expected one of {_BACKENDS}")
        if not isinstance(self.reject_kv_cache_outputs, bool):
            raise bad("reject_kv_cache_outputs", "expected a bool")
        if not _positive_float(self.temperature):
            raise bad("temperature", "expected a finite number > 0")
        if self.output_dtype not in ("float32", "float64"):
            raise bad("output_dtype", "expected 'float32' or 'float64'")
        for name in ("max_batch_tokens", "logprob_chunk_tokens", "packed_row_tokens"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise bad(name, "expected an integer >= 1")
        if not isinstance(self.device, str) or not _valid_device(self.device):
            raise bad("device", "expected 'cpu', 'cuda', 'cuda:N' or 'auto'")
        if self.dtype not in _DTYPES:
            raise bad("dtype", f"expected one of {_DTYPES}")
        if self.packing not in ("auto", "packed", "padded"):
            raise bad("packing", "expected 'auto', 'packed' or 'padded'")


@dataclass
class _Run:
    """Mutable tallies of one ``score`` call."""

    fallbacks: list[FallbackEvent] = field(default_factory=list)
    kv_tensors: int = 0
    kv_bytes: int = 0
    oom_splits: int = 0
    forward_s: float = 0.0
    padded_tokens: int = 0
    fill_tokens: int = 0
    forwards: int = 0
    backends_used: list[str] = field(default_factory=list)
    packed_any: bool = False


class StatelessExecutor:
    """Scores ragged sequences with a reference LM and/or a reward model; stateless between calls.

    ``reference_model``: a ``*ForCausalLM`` (log-probs). ``reward_model``: a
    ``*ForSequenceClassification`` with ``num_labels=1`` (default adapter) or any model served
    through ``reward_adapter``; with an adapter and no reward model, the reference model is used
    (one model, both surfaces).
    """

    def __init__(
        self,
        config: ExecutorConfig,
        reference_model: nn.Module | None = None,
        reward_model: nn.Module | None = None,
        reward_adapter: RewardAdapter | None = None,
        model_name: str | None = None,
        *,
        reward_model_name: str | None = None,
    ) -> None:
        if reference_model is None and reward_model is None:
            raise ConfigError("StatelessExecutor needs a reference_model or a reward_model")
        self.config = config
        self.device = resolve_device(config.device)
        if reward_model is None and reward_adapter is not None:
            reward_model = reference_model
        if reward_model is not None and reward_adapter is None:
            SequenceClassificationAdapter.check(reward_model)
            reward_adapter = SequenceClassificationAdapter()
        self.reference_model = self._place(reference_model)
        self.reward_model = self._place(reward_model)
        self.reward_adapter = reward_adapter
        # One model behind both surfaces and an adapter that can pool precomputed hidden states:
        # `both` then runs the backbone once per batch instead of once per surface.
        self._shared_adapter: HiddenStateRewardAdapter | None = (
            reward_adapter
            if self.reference_model is not None
            and self.reward_model is self.reference_model
            and isinstance(reward_adapter, HiddenStateRewardAdapter)
            else None
        )
        self.model_name = model_name or _name_of(reference_model or reward_model)
        self.reward_model_name = reward_model_name or (
            _name_of(reward_model) if reward_model is not None else None
        )
        if (
            self.reference_model is not None
            and self.reference_model.get_output_embeddings() is None
        ):
            raise ConfigError(f"{type(self.reference_model).__name__} has no LM head")
        if config.mode not in self.modes:
            raise ConfigError(
                f"ExecutorConfig.mode={config.mode!r} but this executor serves {self.modes}"
            )
        self._listeners: list[Callable[[FallbackEvent], None]] = []
        self.load_fallbacks: list[FallbackEvent] = []
        self._last_fallback: FallbackEvent | None = None
        self._backend = self._resolve_backends()
        self._transform = (
            logit_transform_for(self.reference_model) if self.reference_model is not None else None
        )
        self._kv_seen: dict[int, int] = {}  # id(tensor) -> bytes, for the batch in flight
        self._kv_probe = False
        self._last_slots = 0
        self._hooks: list[Any] = []
        for model in self._models():
            for module in {id(m): m for m in (model, backbone_of(model))}.values():
                self._hooks.append(module.register_forward_hook(self._kv_hook))
        self._packed = config.packing != "padded"
        if config.self_check:
            self._self_check()
        log.info("executor ready: %s", self.info)

    # ----------------------------------------------------------------- construction helpers

    @classmethod
    def from_pretrained(
        cls,
        config: ExecutorConfig,
        reference_model: str | None = None,
        reward_model: str | None = None,
        *,
        gguf_file: str | None = None,
        reward_gguf_file: str | None = None,
        trust_remote_code: bool = False,
        revision: str | None = None,
        reward_adapter: RewardAdapter | None = None,
    ) -> StatelessExecutor:
        """Load models from local directories or hub ids (GGUF via ``gguf_file``) and build;
        ``reward_adapter`` replaces the default sequence-classification head reader."""
        if reference_model is None and reward_model is None:
            raise ConfigError("from_pretrained needs reference_model and/or reward_model")
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        common: dict[str, Any] = {
            "device": device,
            "dtype": dtype,
            "trust_remote_code": trust_remote_code,
            "revision": revision,
        }
        ref = (
            load_model(reference_model, kind="causal", gguf_file=gguf_file, **common)
            if reference_model
            else None
        )
        rew = (
            load_model(reward_model, kind="reward", gguf_file=reward_gguf_file, **common)
            if reward_model
            else None
        )
        return cls(
            config,
            ref,
            rew,
            reward_adapter=reward_adapter,
            model_name=reference_model,
            reward_model_name=reward_model,
        )

    def _place(self, model: nn.Module | None) -> Any:
        if model is None:
            return None
        if self.config.dtype != "auto":
            model.to(resolve_dtype(self.config.dtype, self.device))
        model.to(self.device)
        model.eval()
        return model

    def _models(self) -> list[Any]:
        """Distinct models served (the same object twice counts once)."""
        found = [m for m in (self.reference_model, self.reward_model) if m is not None]
        return list({id(m): m for m in found}.values())

    def _resolve_backends(self) -> str:
        active = ""
        for model in self._models():
            dtype = next(model.parameters()).dtype
            try:
                active, event = backends.resolve(
                    model, self.config.attention_backend, self.device, dtype
                )
            except RuntimeError as exc:
                raise ConfigError(str(exc)) from exc
            if event is not None:
                log.warning("attention backend fallback at load: %s", event.message)
                self.load_fallbacks.append(event)
                self._last_fallback = event
        return active

    def _self_check(self) -> None:
        """Probe: fast path vs the model's own logits, packed rows vs one-by-one forwards."""
        model = self.reference_model or self.reward_model
        assert model is not None
        vocab = self.vocab_size
        seqs = [
            PreparedSequence(ids=ids, scored=np.arange(1, len(ids), dtype=np.int64))
            for ids in ((np.arange(n) * 7919 + 17 * n + 3) % vocab for n in (5, 9, 3))
        ]
        mode: Mode = "both" if "both" in self.modes else self.modes[0]
        self._kv_probe = True
        try:
            alone = [self._compute([s], [0], mode, 1.0, packed=True)[0] for s in seqs]
            tol = 1e-3 if next(model.parameters()).dtype == torch.float32 else 0.25
            if self.reference_model is not None:
                for s, got in zip(seqs, alone, strict=True):
                    ids = torch.from_numpy(s.ids)[None].to(self.device)
                    with torch.inference_mode():
                        logits = self.reference_model(input_ids=ids, use_cache=False).logits[0]
                    want = naive_token_logps(logits[:-1], ids[0, 1:]).cpu().numpy()
                    assert got.logps is not None
                    if not np.allclose(got.logps, want, atol=tol, rtol=0):
                        raise ConfigError(
                            f"{type(self.reference_model).__name__}: backbone + LM head does not "
                            "reproduce the model's own logits (unsupported logit post-processing); "
                            f"max |diff| {np.abs(got.logps - want).max():.3g}"
                        )
            if self._packed and self._backend in backends.PACKABLE:
                packed = self._compute(seqs, list(range(len(seqs))), mode, 1.0, packed=True)
                if all(_close(a, b, tol) for a, b in zip(alone, packed, strict=True)):
                    return
                reason = "packed rows disagree with one-by-one forwards"
            else:
                reason = f"backend {self._backend} is not known to isolate packed sequences"
            if self.config.packing == "packed":
                raise ConfigError(f"packing='packed' requested but {reason}")
            if self._packed:
                event = FallbackEvent("packed", "padded", "no_packing", reason, "load")
                log.warning("packing disabled: %s", reason)
                self.load_fallbacks.append(event)
                self._last_fallback = event
                self._packed = False
        finally:
            self._kv_probe = False
            self._kv_seen.clear()

    # ----------------------------------------------------------------- public surface

    @property
    def vocab_size(self) -> int:
        """Smallest input-embedding size among the served models: valid ids are ``[0, vocab)``."""
        sizes = [int(m.get_input_embeddings().weight.shape[0]) for m in self._models()]
        return min(sizes)

    @property
    def max_positions(self) -> int | None:
        """Longest sequence the models accept (``max_position_embeddings``/``n_positions``)."""
        limits = []
        for model in self._models():
            config = getattr(model, "config", None)
            for name in ("max_position_embeddings", "n_positions"):
                value: Any = getattr(config, name, None)
                if is_int(value) and value > 0:
                    limits.append(int(value))
                    break
        return min(limits) if limits else None

    @property
    def modes(self) -> tuple[Mode, ...]:
        """Modes this executor can serve."""
        found: list[Mode] = []
        if self.reference_model is not None:
            found.append("reference")
        if self.reward_model is not None:
            found.append("reward")
        if len(found) == 2:
            found.append("both")
        return tuple(found)

    @property
    def attention_backend(self) -> str:
        """The attention backend active between calls."""
        return self._backend

    @property
    def packed(self) -> bool:
        """Whether batches are packed padding-free (else length-sorted padded buckets)."""
        return self._packed

    @property
    def info(self) -> dict[str, Any]:
        """Identity of what produces the scores (goes into result metadata and logs)."""
        import transformers

        model = self.reference_model or self.reward_model
        assert model is not None
        return {
            "model": self.model_name,
            "reward_model": self.reward_model_name,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "device": str(self.device),
            "attention_backend": self._backend,
            "requested_backend": self.config.attention_backend,
            "fallback": self._last_fallback.as_dict() if self._last_fallback else None,
            "packing": "packed" if self._packed else "padded",
            "modes": list(self.modes),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }

    def close(self) -> None:
        """Detach the executor's hooks from the models (they stay usable elsewhere)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._listeners.clear()

    def add_fallback_listener(self, callback: Callable[[FallbackEvent], None]) -> None:
        """Call ``callback(event)`` on every run-time fallback (load-time: ``load_fallbacks``)."""
        self._listeners.append(callback)

    def validate(
        self,
        seqs: Sequence[SequenceInput],
        mode: Mode | None = None,
        temperature: float | None = None,
    ) -> None:
        """Raise ``BadRequest`` / ``TooLong`` / ``UnsupportedMode`` if ``seqs`` cannot be scored."""
        self._prepare(seqs, *self._call_args(mode, temperature))

    def score(
        self,
        seqs: Sequence[SequenceInput],
        *,
        mode: Mode | None = None,
        temperature: float | None = None,
    ) -> ScoreOutput:
        """Validate, batch under ``max_batch_tokens``, run, and return scores in input order.

        Raises the validation errors of ``validate``; ``KVCacheRejected`` when a model returns
        a cache (and rejection is on); ``AttentionBackendError`` when no backend can run a batch;
        ``InternalError`` for any other failure. A sequence that does not fit on the device even
        alone gets ``SequenceScore(error=TooLong(...))``.
        """
        started = time.perf_counter()
        mode, temp = self._call_args(mode, temperature)
        prepared = self._prepare(seqs, mode, temp)
        reset_peak(self.device)
        run = _Run()
        results: list[SequenceScore | None] = [None] * len(prepared)
        lengths = [len(p.ids) for p in prepared]
        budget = self.config.max_batch_tokens
        if self._packed:
            row = self._row_tokens(self._backend)
            forwards = plan_packed_forwards(lengths, budget, row)
            plan = [[i for r in fwd for i in r] for fwd in forwards]
        else:
            plan = plan_padded(lengths, budget)
        for group in plan:
            self._run_group(group, prepared, mode, temp, results, run)
        allocated, reserved = read_peak(self.device)
        scored = sum(len(p.scored) for p in prepared if p.scored is not None)
        metrics = BatchMetrics(
            batch_size=len(prepared),
            real_tokens=sum(lengths),
            padded_tokens=run.padded_tokens,
            scored_tokens=scored if mode != "reward" else 0,
            elapsed_s=time.perf_counter() - started,
            forward_s=run.forward_s,
            backend=run.backends_used[-1] if run.backends_used else self._backend,
            requested_backend=self.config.attention_backend,
            fallbacks=run.fallbacks,
            kv_output_tensors=run.kv_tensors,
            kv_output_bytes=run.kv_bytes,
            kv_rejected=False,
            peak_allocated_bytes=allocated,
            peak_reserved_bytes=reserved,
            device_total_bytes=device_total_bytes(self.device),
            oom_splits=run.oom_splits,
            packed=run.packed_any,
            forwards=run.forwards,
            packed_fill_tokens=run.fill_tokens,
        )
        return ScoreOutput(
            scores=[r if r is not None else SequenceScore() for r in results], metrics=metrics
        )

    # ----------------------------------------------------------------- validation

    def _call_args(self, mode: str | None, temperature: float | None) -> tuple[Mode, float]:
        mode = self.config.mode if mode is None else mode
        if mode not in MODES:
            raise BadRequest(f"unknown mode {mode!r}; expected one of {MODES}")
        if mode not in self.modes:
            raise UnsupportedMode(f"mode {mode!r} is not served here (serves {list(self.modes)})")
        temp = self.config.temperature if temperature is None else temperature
        if not _positive_float(temp):
            raise BadRequest(f"temperature must be a finite number > 0, got {temp!r}")
        return mode, float(temp)

    def _prepare(
        self, seqs: Sequence[SequenceInput], mode: Mode, temperature: float
    ) -> list[PreparedSequence]:
        if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Sequence):
            raise BadRequest(f"expected a list of SequenceInput, got {type(seqs).__name__}")
        if len(seqs) == 0:
            raise BadRequest("no sequences to score")
        vocab, limit = self.vocab_size, self.max_positions
        needs_scored = mode != "reward"
        out = []
        for i, seq in enumerate(seqs):
            try:
                out.append(prepare_sequence(seq, vocab, limit, needs_scored))
            except (BadRequest, TooLong) as exc:
                raise type(exc)(f"sequence {i}: {exc.message}") from None
        return out

    # ----------------------------------------------------------------- running

    def _run_group(
        self,
        group: list[int],
        prepared: list[PreparedSequence],
        mode: Mode,
        temp: float,
        results: list[SequenceScore | None],
        run: _Run,
    ) -> None:
        """Run one planned batch; on device OOM split it in halves (one sequence -> TooLong)."""
        try:
            scores = self._run_with_fallback(group, prepared, mode, temp, run)
        except torch.OutOfMemoryError as exc:
            free_device_memory(self.device)
            if len(group) == 1:
                n = len(prepared[group[0]].ids)
                log.warning("sequence of %d tokens does not fit on %s", n, self.device)
                results[group[0]] = SequenceScore(
                    error=TooLong(
                        f"sequence of {n} tokens does not fit on {self.device}: {exc}"[:500]
                    )
                )
                return
            run.oom_splits += 1
            half = len(group) // 2
            log.warning("out of memory on a batch of %d sequences; splitting", len(group))
            self._run_group(group[:half], prepared, mode, temp, results, run)
            self._run_group(group[half:], prepared, mode, temp, results, run)
            return
        for i, score in zip(group, scores, strict=True):
            results[i] = score

    def _run_with_fallback(
        self, group: list[int], prepared: list[PreparedSequence], mode: Mode, temp: float, run: _Run
    ) -> list[SequenceScore]:
        """Run a batch; an attention-kernel error retries it on the next backend(s)."""
        seqs = [prepared[i] for i in group]
        try:
            return self._run_batch(seqs, group, mode, temp, run, self._backend)
        except (torch.OutOfMemoryError, ScoringError):
            raise
        except Exception as exc:
            if not backends.is_attention_kernel_error(exc):
                raise InternalError(f"forward failed: {type(exc).__name__}: {exc}"[:500]) from exc
            failed, first_exc = self._backend, exc
        errors = [f"{failed}: {type(first_exc).__name__}: {first_exc}"[:300]]
        candidate = backends.next_backend(failed)
        while candidate is not None:
            with ExitStack() as stack:
                try:
                    for model in self._models():
                        stack.enter_context(backends.temporary_backend(model, candidate))
                except Exception as exc:  # switch refused; configs already restored
                    errors.append(f"{candidate}: cannot switch: {exc}"[:300])
                    candidate = backends.next_backend(candidate)
                    continue
                try:
                    scores = self._run_batch(seqs, group, mode, temp, run, candidate)
                except (torch.OutOfMemoryError, ScoringError):
                    raise
                except Exception as exc:
                    if not backends.is_attention_kernel_error(exc):
                        raise InternalError(
                            f"forward failed on {candidate}: {type(exc).__name__}: {exc}"[:500]
                        ) from exc
                    errors.append(f"{candidate}: {type(exc).__name__}: {exc}"[:300])
                    candidate = backends.next_backend(candidate)
                    continue
            event = FallbackEvent(failed, candidate, "kernel_error", "; ".join(errors), "run")
            self._record(event, run)
            return scores
        raise AttentionBackendError(
            "no attention backend could run the batch: " + "; ".join(errors)
        )

    def _record(self, event: FallbackEvent, run: _Run) -> None:
        log.warning(
            "attention backend fallback at run time: %s -> %s (%s)",
            event.requested,
            event.used,
            event.message,
        )
        run.fallbacks.append(event)
        self._last_fallback = event
        for callback in self._listeners:
            try:
                callback(event)
            except Exception:  # a metrics callback must never break scoring
                log.exception("fallback listener failed")

    def _run_batch(
        self,
        seqs: list[PreparedSequence],
        group: list[int],
        mode: Mode,
        temp: float,
        run: _Run,
        backend: str,
    ) -> list[SequenceScore]:
        packed = self._packed and backend in backends.PACKABLE
        self._kv_seen.clear()
        t0 = time.perf_counter()
        scores = self._compute(seqs, group, mode, temp, packed=packed, backend=backend)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        run.forward_s += time.perf_counter() - t0
        run.forwards += 1
        extra = max(0, self._last_slots - sum(len(s.ids) for s in seqs))
        if packed:
            run.fill_tokens += extra  # tails of packed rows shorter than the longest
        else:
            run.padded_tokens += extra  # right padding of a padded bucket
        run.backends_used.append(backend)
        run.packed_any = run.packed_any or packed
        if self._kv_seen:
            tensors, nbytes = len(self._kv_seen), sum(self._kv_seen.values())
            self._kv_seen.clear()
            run.kv_tensors += tensors
            run.kv_bytes += nbytes
            if self.config.reject_kv_cache_outputs:
                raise KVCacheRejected(
                    f"model returned a KV cache despite use_cache=False "
                    f"({tensors} tensors, {nbytes} bytes); batch rejected",
                    kv_output_tensors=tensors, kv_output_bytes=nbytes,
                )  # fmt: skip
            log.warning(
                "model returned a KV cache (%d tensors, %d bytes); dropped", tensors, nbytes
            )
        return scores

    def _row_tokens(self, backend: str) -> int:
        """Packed row cap: the whole budget where the kernel skips cross-sequence blocks."""
        if backend.startswith("flash_attention") or backend == "flex_attention":
            return self.config.max_batch_tokens
        return self.config.packed_row_tokens

    def _compute(
        self,
        seqs: list[PreparedSequence],
        group: list[int],
        mode: Mode,
        temp: float,
        *,
        packed: bool,
        backend: str | None = None,
    ) -> list[SequenceScore]:
        """One backbone forward per distinct model for ``seqs`` (a model serving both surfaces
        through a ``HiddenStateRewardAdapter`` runs once); no fallback or OOM handling here."""
        ids = [s.ids for s in seqs]
        if packed:
            rows = plan_packed([len(x) for x in ids], self._row_tokens(backend or self._backend))
            order = [j for row in rows for j in row]  # batch order -> index into seqs
            batch = pack_rows([[ids[j] for j in row] for row in rows], [group[j] for j in order])
        else:
            order = list(range(len(seqs)))
            batch = pad(ids, group)
        ordered = [seqs[j] for j in order]
        self._last_slots = batch.slot_tokens
        batch = batch.to(self.device)
        out_dtype = np.float64 if self.config.output_dtype == "float64" else np.float32
        scores = [SequenceScore() for _ in seqs]
        with torch.inference_mode():
            rewarded: RewardOutput | None = None
            if mode in ("reference", "both"):
                model = self.reference_model
                assert model is not None
                hidden = backbone_hidden(model, batch)  # [R, T, H]: the one forward of `model`
                if mode == "both" and self._shared_adapter is not None:
                    # One model, both surfaces: the reward head reads the same hidden states.
                    rewarded = self._shared_adapter.from_hidden(model, batch, hidden)
                picked, labels, sizes = self._scored_rows(hidden, batch, ordered)
                del hidden  # the LM-head chunks below need only the scored rows
                for j, logps in zip(order, self._logps(picked, labels, sizes, temp), strict=True):
                    scores[j].logps = logps.cpu().numpy().astype(out_dtype, copy=False)
            if mode in ("reward", "both"):
                assert self.reward_adapter is not None and self.reward_model is not None
                if rewarded is None:
                    rewarded = self.reward_adapter(self.reward_model, batch)
                for k, j in enumerate(order):
                    scores[j].reward = float(rewarded.rewards[k])
                    if rewarded.token_scores is not None:
                        scores[j].token_scores = (
                            rewarded.token_scores[k].cpu().numpy().astype(out_dtype, copy=False)
                        )
        return scores

    def _scored_rows(
        self, hidden: torch.Tensor, batch: ForwardBatch, seqs: list[PreparedSequence]
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Hidden states ``[N, H]`` of the positions that predict a scored token, their labels
        ``[N]`` and the number of scored tokens per sequence, batch order."""
        starts = batch.starts.cpu().numpy()
        scored = [s.scored for s in seqs]
        assert all(p is not None for p in scored)
        where = np.concatenate([st + p - 1 for st, p in zip(starts, scored, strict=True)])
        labels = np.concatenate([s.ids[p] for s, p in zip(seqs, scored, strict=True)])
        picked = gather_flat(hidden, torch.from_numpy(where).to(self.device))  # [N, H]
        sizes = [len(p) for p in scored]  # type: ignore[arg-type]
        return picked, torch.from_numpy(labels).to(self.device), sizes

    def _logps(
        self, picked: torch.Tensor, labels: torch.Tensor, sizes: list[int], temp: float
    ) -> list[torch.Tensor]:
        """Completion-only chunked log-probs of ``labels`` from the scored rows, per sequence."""
        model = self.reference_model
        assert model is not None
        logps = chunked_token_logps(
            picked,
            model.get_output_embeddings(),
            labels,
            temperature=temp,
            chunk_tokens=self.config.logprob_chunk_tokens,
            transform=self._transform,
        )  # [N]
        return list(torch.split(logps, sizes))

    # ----------------------------------------------------------------- KV rejection

    def _kv_hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        """Forward hook: tally (and in warn mode drop) any cache object in a model output."""
        found = cache_outputs(output)
        if not found:
            return None
        for _, value in found:
            for tensor in tensors_in(value):
                self._kv_seen[id(tensor)] = tensor.numel() * tensor.element_size()
        if self.config.reject_kv_cache_outputs or self._kv_probe:
            return None
        if isinstance(output, dict):  # ModelOutput: item assignment updates key and attribute
            for key, _ in found:
                output[key] = None
            return output
        if isinstance(output, tuple):
            drop = {key for key, _ in found}
            return tuple(None if i in drop else v for i, v in enumerate(output))
        for key, _ in found:
            setattr(output, key, None)
        return output


# --------------------------------------------------------------------- module helpers


def _positive_float(value: Any) -> bool:
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
        and float(value) > 0
    )


def _valid_device(device: str) -> bool:
    if device in ("cpu", "cuda", "auto", "mps"):
        return True
    head, _, index = device.partition(":")
    return head == "cuda" and index.isdigit()


def _name_of(model: nn.Module | None) -> str | None:
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", None)
    return str(name) if name else (type(model).__name__ if model is not None else None)


def _close(a: SequenceScore, b: SequenceScore, tol: float) -> bool:
    if (
        a.logps is not None
        and b.logps is not None
        and not np.allclose(a.logps, b.logps, atol=tol, rtol=0)
    ):
        return False
    both = a.reward is not None and b.reward is not None
    return not (both and abs(a.reward - b.reward) > tol * 10)  # type: ignore[operator]
