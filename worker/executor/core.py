"""``StatelessExecutor``: the torch ``Scorer``, ragged sequences in, log-probs and/or rewards out.

Construction settles everything that is fixed for the executor's life: the models (placed, eval
mode), the attention backend (``backends.resolve``), the KV guard's hooks, and whether batches
are packed (the load-time probe, ``selfcheck``). ``prepare`` plans a request once
(``call.plan_calls``); ``run`` turns the plans of a batch into ``ScoreCall`` s (``call``) and
hands their batches to the ``BatchRunner`` (``fallback``), which runs them through
``BatchForward`` (``forward``). Nothing a call computes is kept on the
executor, so calls may overlap (see ``fallback`` for the one gate they share).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from worker.errors import ConfigError
from worker.executor import backends
from worker.executor.call import ScoreCall, call_args, concat_outputs, merge_plans, plan_calls
from worker.executor.config import ExecutorConfig, Layout
from worker.executor.fallback import BatchRunner
from worker.executor.forward import BatchForward
from worker.executor.head.hidden import head_info
from worker.executor.head.tiles import lm_head_path
from worker.executor.kvcache import KVGuard
from worker.executor.memory import device_total_bytes, read_peak, reset_peak
from worker.executor.rewards.pooling import RewardAdapter, backbone_of
from worker.executor.rewards.surface import merge_outputs, resolve_head, reward_surface
from worker.executor.selfcheck import allowed_layouts
from worker.executor.student import students
from worker.executor.tree.check import sharing_check
from worker.executor.vision.check import checked_intake, checked_reward
from worker.executor.vision.intake import plan_images
from worker.executor.vision.processor import image_processor_for
from worker.executor.weights.loading import (
    load_models,
    load_tokenizers,
    resolve_device,
    resolve_dtype,
    timed,
)
from worker.executor.weights.router import WeightsConfig, WeightsRouter, refuse
from worker.modes import Mode
from worker.request import ScoreRequest
from worker.scorer.outputs import FallbackEvent, ScoreOutput
from worker.scorer.plan import DirectScoring, Prepared

if TYPE_CHECKING:
    from worker.scorer import Scorer

log = logging.getLogger(__name__)


class StatelessExecutor(DirectScoring):
    """Scores ragged sequences with a reference LM and/or a reward model; stateless between calls.

    ``reference_model``: a ``*ForCausalLM`` (log-probs). ``reward_model``: a
    ``*ForSequenceClassification`` with ``num_labels=1`` (default adapter) or any model served
    through ``reward_adapter``; with an adapter and no reward model, the reference model is used
    (one model, both surfaces). Implements ``worker.scorer.Scorer``. ``forward_type`` builds
    what runs the batches (a tensor-parallel executor, ``worker.executor.parallel``, sets its own).
    ``image_processor`` / ``reward_image_processor``: a vision-language model's own (``vision``).
    """

    forward_type: Callable[..., BatchForward] = BatchForward

    def __init__(
        self,
        config: ExecutorConfig,
        reference_model: nn.Module | None = None,
        reward_model: nn.Module | None = None,
        reward_adapter: RewardAdapter | None = None,
        model_name: str | None = None,
        *,
        reward_model_name: str | None = None,
        weights: WeightsConfig | None = None,
        tokenizers: tuple[Any, Any] | None = None,
        startup_seconds: dict[str, float] | None = None,
        image_processor: Any = None,
        reward_image_processor: Any = None,
    ) -> None:
        if reference_model is None and reward_model is None:
            raise ConfigError("StatelessExecutor needs a reference_model or a reward_model")
        self.config = config
        self.device = resolve_device(config.device)
        if reward_model is None and reward_adapter is not None:
            reward_model = reference_model
        head, reward_adapter = resolve_head(reward_model, reward_adapter, config.reward_index)
        self.startup_seconds = {} if startup_seconds is None else startup_seconds  # load phases
        self.reference_model = _place(reference_model, config, self.device)
        self.reward_model = _place(reward_model, config, self.device)
        self.reward_adapter = reward_adapter
        self.model_name = model_name or _name_of(reference_model or reward_model)
        self.reward_model_name = reward_model_name or _name_of(reward_model)
        ref = self.reference_model
        if ref is not None and ref.get_output_embeddings() is None:
            raise ConfigError(f"{type(ref).__name__} has no LM head")
        if config.mode not in self.modes:
            raise ConfigError(
                f"ExecutorConfig.mode={config.mode!r} but this executor serves {self.modes}"
            )
        self._listeners: list[Callable[[FallbackEvent], None]] = []
        self._listeners_lock = threading.Lock()
        self._load_fallbacks: list[FallbackEvent] = []
        self._last_fallback: FallbackEvent | None = None
        models, wanted = (self.reference_model, self.reward_model), config.attention_backend
        forward = self.forward_type(config, self.device, *models, reward_adapter)
        backend, events = backends.resolve_all(forward.models, wanted, self.device)
        for fallback in events:
            log.warning("attention backend fallback at load: %s", fallback.message)
            self._on_load_fallback(fallback)
        hooked = {id(m): m for model in forward.models for m in (model, backbone_of(model))}
        self._guard = KVGuard(hooked.values())
        with timed(self.startup_seconds, "self_check"):
            packed, unmasked, refused = allowed_layouts(forward, modes=self.modes, backend=backend)
        for event in refused:
            log.warning("%s layout disabled: %s", event.requested, event.message)
            self._on_load_fallback(event)
        with timed(self.startup_seconds, "sharing_check"):
            why_not = sharing_check(forward, modes=self.modes, backend=backend)
        if why_not is not None and config.prefix_sharing != "off":
            log.warning("prefix sharing off: %s", why_not)
        self.prefix_sharing = "on" if why_not is None else f"off: {why_not}"  # info[...]
        self._runner = BatchRunner(
            config, forward, self._guard, backend=backend, packed=packed, unmasked=unmasked,
            notify=self._on_fallback, share_min=config.min_shared_tokens if why_not is None else 0,
        )  # fmt: skip
        self._rewards = reward_surface(self.reward_model, head, tokenizers, forward)
        text: dict[str, Any] = {"packed": packed, "unmasked": unmasked, "backend": backend,
                "sharing": self._runner.share_min > 0}  # what the text path runs  # fmt: skip
        self._vision, self._runner.vision = checked_intake(
            forward, image_processor, config, **text
        )  # images, their path and layouts checked
        self._reward_images, self._runner.reward_vision = checked_reward(
            forward, self._vision, reward_image_processor, config, **text
        )  # a reward model's own images, checked, its layouts; or why it takes none
        self._head, self._tokenizer = head_info(ref, forward.transform), (tokenizers or [None])[0]
        # per-job adapters and versions (docs/models.md); None: base weights only
        self._weights = (
            WeightsRouter(weights, forward.models, device=self.device, build=self._version_executor,
                          kind="causal" if self.reference_model is not None else "reward")
            if weights is not None and weights.enabled else None
        )  # fmt: skip
        log.info("executor ready: %s", self.info)

    def _version_executor(self, model: nn.Module) -> StatelessExecutor:
        """The executor serving a version: ``model`` in the place of the served base."""
        if self.reference_model is None:
            return type(self)(self.config, None, model, self.reward_adapter)
        shared = self.reward_model is self.reference_model
        adapter = self.reward_adapter if shared else None
        mode = self.config.mode if shared or self.config.mode == "reference" else "reference"
        config = replace(self.config, mode=mode)
        return type(self)(config, model, model if shared else None, adapter)

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
        weights: WeightsConfig | None = None,
        reward_head: str = "auto",
    ) -> StatelessExecutor:
        """Load models from local directories, hub ids or ``.gguf`` files (a directory plus
        ``gguf_file`` also works) and build; ``reward_adapter`` replaces the default
        sequence-classification head reader; ``reward_head`` picks the reward model's class
        (``auto``: its config's architecture). Tokenizers stored with the models are loaded
        (the reward model's renders ``messages``; the two are compared)."""
        device = resolve_device(config.device)
        timings: dict[str, float] = {}  # the load phases (worker.observability.startup)
        ref, rew = load_models(
            reference_model, reward_model, device=device, dtype=resolve_dtype(config.dtype, device),
            gguf_file=gguf_file, reward_gguf_file=reward_gguf_file,
            trust_remote_code=trust_remote_code, revision=revision, reward_head=reward_head,
            timings=timings,
        )  # fmt: skip
        tokenizers = load_tokenizers(reference_model, reward_model, gguf_file, reward_gguf_file)
        return cls(
            config, ref, rew, reward_adapter=reward_adapter, model_name=reference_model,
            reward_model_name=reward_model, weights=weights, tokenizers=tokenizers,
            startup_seconds=timings, image_processor=image_processor_for(ref, reference_model),
            reward_image_processor=reward_processor_for(rew, reward_model, ref),
        )  # fmt: skip

    def _on_load_fallback(self, event: FallbackEvent) -> None:
        self._load_fallbacks.append(event)
        self._last_fallback = event

    def _on_fallback(self, event: FallbackEvent) -> None:
        """A run-time fallback: remember it for ``info`` and tell the listeners."""
        self._last_fallback = event
        with self._listeners_lock:
            listeners = list(self._listeners)
        for callback in listeners:
            try:
                callback(event)
            except Exception:  # a metrics callback must never break scoring
                log.exception("fallback listener failed")

    # ----------------------------------------------------------------- public surface

    @property
    def vocab_size(self) -> int:
        """Smallest input-embedding size among the served models: valid ids are ``[0, vocab)``."""
        return self._runner.forward.vocab_size

    @property
    def max_positions(self) -> int | None:
        """Longest sequence the models accept (``max_position_embeddings``/``n_positions``)."""
        return self._runner.forward.max_positions

    @property
    def modes(self) -> tuple[Mode, ...]:
        """Modes this executor can serve."""
        found: tuple[Mode, ...] = ("reference",) if self.reference_model is not None else ()
        found += ("reward",) if self.reward_model is not None else ()
        return (*found, "both") if len(found) == 2 else found

    @property
    def attention_backend(self) -> str:
        """The attention backend active between calls."""
        return self._runner.backend

    @property
    def packed(self) -> bool:
        """Whether batches are packed padding-free (else length-sorted buckets)."""
        return self.layout == "packed"

    @property
    def layout(self) -> Layout:
        """The batch layout on the active backend: ``packed``, ``unmasked`` or ``padded``."""
        return self._runner.layout()

    @property
    def load_fallbacks(self) -> list[FallbackEvent]:
        """Fallbacks taken while loading (attention backend, packing), oldest first."""
        return list(self._load_fallbacks)

    def resident(self) -> dict[str, Any]:
        """Resident per-job weights (``Residency.summary``); ``{}`` without weight roots."""
        return self._weights.residency.summary() if self._weights is not None else {}

    @property
    def info(self) -> dict[str, Any]:
        """Identity of what produces the scores (goes into result metadata and logs)."""
        import transformers

        model, last = self.reference_model or self.reward_model, self._last_fallback
        vision = self._vision
        return {
            "model": self.model_name,
            "reward_model": self.reward_model_name,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "device": str(self.device),
            "attention_backend": self._runner.backend,
            "requested_backend": self.config.attention_backend,
            "fallback": last.as_dict() if last else None,
            "packing": self._runner.layout(),
            "prefix_sharing": self.prefix_sharing,
            "lm_head": lm_head_path(self.reference_model, self.config, self.device),
            "head": self._head,  # what turns hidden rows into logits
            "modes": list(self.modes),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            **(self._rewards.info() if self.reward_model is not None else {}),
            **({"vision": {**vision.info, **self._runner.vision.describe()}} if vision else {}),
            **self._reward_images.info(self._runner.reward_vision),
        }

    def close(self) -> None:
        """Detach the executor's hooks from the models (they stay usable elsewhere)."""
        self._guard.close()
        with self._listeners_lock:
            self._listeners.clear()

    def add_fallback_listener(self, callback: Callable[[FallbackEvent], None]) -> None:
        """Call ``callback(event)`` on every run-time fallback (load-time: ``load_fallbacks``)."""
        with self._listeners_lock:
            self._listeners.append(callback)

    def prepare(self, request: ScoreRequest) -> Prepared:
        """Validate and plan ``request`` once (``Scorer.prepare``): student text tokenized,
        messages rendered, sequences checked, the calls decided (``plan_calls``) and costed,
        weights checked. Raises BadRequest, TooLong, UnsupportedMode or ModelNotFound."""
        mode, temp = call_args(self.config, self.modes, request)
        options = request.options
        seqs = students(self._tokenizer, request.seqs, options.outputs, mode)
        seqs = self._rewards.prepare(seqs, mode, options)
        plan = plan_calls(
            self._rewards, seqs, mode, options, vocab=self.vocab_size, limit=self.max_positions
        )
        self._weights.check(options) if self._weights is not None else refuse(options)
        plan = plan_images(self._vision, request, plan, self._reward_images)  # checked, placed
        cost = self._runner.cost(plan)  # tokens through the backbone: shared prefixes once
        return Prepared(replace(request, seqs=tuple(seqs)), mode, temp, plan, cost)

    def run(self, batch: Sequence[Prepared]) -> ScoreOutput:
        """Run prepared requests of one batch key as planned (``Scorer.run``): batched under
        ``max_batch_tokens``, scores in order.

        Raises ``KVCacheRejected`` when a model returns a cache (and rejection is on);
        ``AttentionBackendError`` when no backend can run a batch; ``InternalError`` for any
        other failure. A sequence that does not fit on the device even alone gets
        ``SequenceScore(error=TooLong(...))``. Safe to call from several threads; the
        peak-memory figures of overlapping calls then cover them all (the device counter is one).
        """
        options = batch[0].options
        if self._weights is not None and (options.adapter, options.version) != (None, None):
            return self._weights.score(options, self, lambda ex: ex.run_planned(batch, self))
        refuse(options)
        return self.run_planned(batch, self)

    def run_planned(
        self, batch: Sequence[Prepared], planner: StatelessExecutor | None = None
    ) -> ScoreOutput:
        """``run`` with the weights already chosen: this executor's models run ``batch``. A
        batch planned by another executor (``planner``: the base of a version) whose vocabulary
        or positions differ from this one's is planned again here first."""
        if planner is not None and planner is not self and self._plans_differ(planner):
            batch = [self.prepare(_base_weights(p.request)) for p in batch]
        started = time.perf_counter()
        first = batch[0]
        reset_peak(self.device)
        runner = self._runner
        ran: list[tuple[list[int], list[ScoreCall]]] = []
        for indices, plan in merge_plans(batch):
            calls = [ScoreCall.of(c, first.temperature, first.options, started) for c in plan]
            for call in calls:
                for group in runner.plan(call):
                    runner.run_group(group, call)
            ran.append((indices, calls))
        peak, total = read_peak(self.device), device_total_bytes(self.device)
        outputs = [
            (indices, merge_outputs([
                c.output(backend=runner.backend, requested_backend=self.config.attention_backend,
                         peak=peak, device_total=total)
                for c in calls
            ]))
            for indices, calls in ran
        ]  # fmt: skip
        return concat_outputs(outputs, sum(len(p) for p in batch))

    def _plans_differ(self, other: StatelessExecutor) -> bool:
        """Whether a plan made by ``other`` may not hold here (another vocabulary or length)."""
        return (self.vocab_size, self.max_positions) != (other.vocab_size, other.max_positions)


def reward_processor_for(model: Any, name_or_path: str | None, reference: Any) -> Any:
    """The image processor of a separate image-text reward ``model`` (``None`` when it is the
    reference model, text-only, or its checkpoint has none: it then scores text only)."""
    if model is None or model is reference:
        return None
    try:
        return image_processor_for(model, name_or_path)
    except ConfigError as exc:
        log.warning("reward model without an image processor scores text only: %s", exc)
        return None


def _base_weights(request: ScoreRequest) -> ScoreRequest:
    """``request`` without its adapter and version (already applied by the caller)."""
    options = replace(request.options, adapter=None, version=None)
    return replace(request, options=options)


def _place(model: nn.Module | None, config: ExecutorConfig, device: torch.device) -> Any:
    """``model`` in ``config.dtype`` (unless ``auto``) on ``device``, eval mode."""
    if model is None:
        return None
    if config.dtype != "auto":
        model.to(resolve_dtype(config.dtype, device))
    model.to(device)
    model.eval()
    return model


def _name_of(model: nn.Module | None) -> str | None:
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", None)
    return str(name) if name else (type(model).__name__ if model is not None else None)


if TYPE_CHECKING:

    def _implements_scorer(executor: StatelessExecutor) -> Scorer:
        """Checked by mypy: ``StatelessExecutor`` implements the protocol the daemon drives."""
        return executor
