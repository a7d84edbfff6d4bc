"""One batch's forward: lay the sequences out (packed rows, an unmasked or a padded bucket), run
each distinct model once with ``use_cache=False``, and read completion-only log-probs and pooled
rewards.

``BatchForward`` holds the served models and what it needs to read them (LM-head transform,
reward adapter, device, output dtype); it keeps nothing between batches: ``compute`` returns the
scores and the number of token slots the forward held. No fallback, OOM or KV handling here
(``fallback.BatchRunner`` wraps it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
import torch

from worker.errors import ConfigError
from worker.executor.config import ExecutorConfig, Layout
from worker.executor.head.hidden import HIDDEN_TORCH, head_request, host_array
from worker.executor.head.logprobs import chunked_token_logps, logit_transform_for
from worker.executor.head.teacher import block_units, chunk_rows_for, chunked_token_outputs
from worker.executor.head.tiles import tileable, tiled_token_logps
from worker.executor.packing import (
    ForwardBatch,
    gather_flat,
    pack_rows,
    pad,
    pad_unmasked,
    plan_packed,
)
from worker.executor.rewards.pooling import (
    HiddenStateRewardAdapter,
    RewardAdapter,
    RewardOutput,
    backbone_hidden,
)
from worker.executor.rewards.steps import head_kind, step_scores
from worker.executor.tree.attention import tree_backend
from worker.executor.tree.layout import tree_batch
from worker.executor.tree.trie import SharedGroup
from worker.executor.vision.arch import vision_model
from worker.executor.vision.features import tower_inputs
from worker.executor.vision.layout import with_images
from worker.modes import LOGPROB_MODES, REWARD_MODES, Mode
from worker.request import DEFAULT_OPTIONS, ScoreOptions
from worker.scorer.align import span_arrays
from worker.scorer.inputs import PreparedSequence, is_int
from worker.scorer.outputs import SequenceScore
from worker.scorer.teacher import LOGPS_ONLY, TokenOutputs


@dataclass(frozen=True)
class Computed:
    """What one forward produced: scores in the order of its sequences, and the token slots it
    held (real tokens plus right padding, or plus the fill of packed rows shorter than the
    longest)."""

    scores: list[SequenceScore]
    slot_tokens: int
    vision_images: int = 0  # images through the vision tower (distinct per forward)
    vision_s: float = 0.0


class BatchForward:
    """Runs one planned batch through the served models (log-probs and/or rewards).

    ``reference_model``: a ``*ForCausalLM`` (log-probs) or ``None``; ``reward_model`` with its
    ``reward_adapter``, or ``None``. When one model serves both surfaces through a
    ``HiddenStateRewardAdapter``, ``mode="both"`` runs its backbone once per batch.
    """

    keeps_hidden = True  # False: asked ``hidden`` rows are neither cast nor copied (TP follower)

    def __init__(
        self,
        config: ExecutorConfig,
        device: torch.device,
        reference_model: Any,
        reward_model: Any,
        reward_adapter: RewardAdapter | None,
    ) -> None:
        self.config = config
        self.device = device
        self.reference_model = reference_model
        self.reward_model = reward_model
        self.reward_adapter = reward_adapter
        self.shared_adapter: HiddenStateRewardAdapter | None = (
            reward_adapter
            if reference_model is not None
            and reward_model is reference_model
            and isinstance(reward_adapter, HiddenStateRewardAdapter)
            else None
        )
        self.transform = (
            logit_transform_for(reference_model) if reference_model is not None else None
        )
        self.out_dtype = np.float64 if config.output_dtype == "float64" else np.float32
        #: The served vision-language reference model (``None``: text-only).
        self.vision = vision_model(reference_model) if reference_model is not None else None
        same = reward_model is reference_model  # one model: the reference's ``VisionModel``
        self.reward_vision = self.vision if same else vision_of(reward_model)  # reward batches'
        found = [m for m in (reference_model, reward_model) if m is not None]
        #: Distinct models served (the same object twice counts once).
        self.models: tuple[Any, ...] = tuple({id(m): m for m in found}.values())

    @property
    def vocab_size(self) -> int:
        """Smallest input-embedding size among the models: valid ids are ``[0, vocab)``."""
        return min(int(m.get_input_embeddings().weight.shape[0]) for m in self.models)

    @property
    def max_positions(self) -> int | None:
        """Longest sequence the models accept (``max_position_embeddings``/``n_positions``)."""
        limits = []
        for model in self.models:
            config = getattr(model, "config", None)
            for name in ("max_position_embeddings", "n_positions"):
                value: Any = getattr(config, name, None)
                if is_int(value) and value > 0:
                    limits.append(int(value))
                    break
        return min(limits) if limits else None

    def compute(
        self,
        seqs: list[PreparedSequence],
        group: list[int],
        mode: Mode,
        temp: float,
        *,
        layout: Layout,
        row_tokens: int,
        options: ScoreOptions = DEFAULT_OPTIONS,
        features: dict[str, Any] | None = None,
    ) -> Computed:
        """One backbone forward per distinct model for ``seqs`` (``group``: their indices in the
        call, carried as the batch's sequence ids) in ``layout``; packed rows hold at most
        ``row_tokens``; ``options.outputs``: the per-position arrays to read besides (or instead
        of) logps; ``features``: the call's vision-tower features by image (``tower_inputs``)."""
        ids = [s.ids for s in seqs]
        if layout == "packed":
            rows = plan_packed([len(x) for x in ids], row_tokens)
            order = [j for row in rows for j in row]  # batch order -> index into seqs
            batch = pack_rows([[ids[j] for j in row] for row in rows], [group[j] for j in order])
        else:
            order = list(range(len(seqs)))
            batch = pad_unmasked(ids, group) if layout == "unmasked" else pad(ids, group)
        vlm, model = self._reader(mode)
        batch = with_images(vlm, batch, [seqs[j] for j in order]).to(self.device)
        tower = tower_inputs(model, batch, self.device, features, self.config.image_sharing)
        return self._run(batch, seqs, order, mode, temp, options, tower)

    def _reader(self, mode: Mode) -> tuple[Any, Any]:
        """The ``VisionModel`` and the model a ``mode`` batch is laid out for (reward or not)."""
        if mode == "reward":
            return self.reward_vision, self.reward_model
        return self.vision, self.reference_model

    def compute_tree(
        self,
        seqs: list[PreparedSequence],
        group: list[int],
        rows: list[SharedGroup],
        mode: Mode,
        temp: float,
        *,
        kernel: str,
        options: ScoreOptions = DEFAULT_OPTIONS,
        windows: list[int | None] | None = None,
        features: dict[str, Any] | None = None,
    ) -> Computed:
        """``compute`` for tree rows (``tree.layout``): ``rows``' members index ``seqs``, each
        row one shared prefix and its continuations, the attention ``tree_attention`` in
        ``kernel`` math (``sdpa``/``eager``/``flex``). The models run on the ``scoring_tree``
        backend for this forward; the caller holds them alone. ``slot_tokens``: the rows' slots.
        ``windows``: filled with the sliding window of every attention call (the load check);
        ``features`` as in ``compute``."""
        batch, order = tree_batch([s.ids for s in seqs], rows, group)
        seen = windows if windows is not None else []
        batch = replace(batch, tree=replace(batch.tree, kernel=kernel, windows=seen))  # type: ignore[type-var]
        vlm, model = self._reader(mode)
        batch = with_images(vlm, batch, [seqs[j] for j in order]).to(self.device)
        # the tower on the model's own attention, before the switch
        tower = tower_inputs(model, batch, self.device, features, self.config.image_sharing)
        with tree_backend(self.models):
            return self._run(batch, seqs, order, mode, temp, options, tower)

    def _run(
        self,
        batch: ForwardBatch,
        seqs: list[PreparedSequence],
        order: list[int],
        mode: Mode,
        temp: float,
        options: ScoreOptions,
        tower: tuple[dict[str, Any], int, float],
    ) -> Computed:
        """The forward of a laid-out ``batch`` on the device (``order``: batch order -> index
        into ``seqs``); ``tower``: its image inputs (``vision.features.tower_inputs``)."""
        slots = batch.slot_tokens
        scores = [SequenceScore() for _ in seqs]
        extra, *seen = tower
        with torch.inference_mode():
            rewarded: RewardOutput | None = None
            if mode in LOGPROB_MODES:
                spec = options.outputs
                rewarded = self._logprobs(
                    batch, [seqs[j] for j in order], order, mode, temp, scores, spec, extra
                )
            if mode in REWARD_MODES and options.step is not None:  # process rewards
                self._steps(batch, [seqs[j] for j in order], order, options, scores)
            elif mode in REWARD_MODES and self.reward_adapter is not None:
                assert self.reward_model is not None
                if rewarded is None:
                    rewarded = pooled(self.reward_adapter, self.reward_model, batch, extra, mode)
                for k, j in enumerate(order):
                    scores[j].reward = float(rewarded.rewards[k])
                    if rewarded.token_scores is not None:
                        scores[j].token_scores = self._host(rewarded.token_scores[k])
                    if rewarded.objectives is not None:  # multi-objective head
                        scores[j].rewards = rewarded.objectives[k].cpu().numpy()
            for j, s in enumerate(seqs):
                scores[j].rm_tokens = s.rm_tokens
        return Computed(
            scores=scores, slot_tokens=slots, vision_images=int(seen[0]), vision_s=float(seen[1])
        )

    def _steps(
        self,
        batch: ForwardBatch,
        ordered: list[PreparedSequence],
        order: list[int],
        options: ScoreOptions,
        scores: list[SequenceScore],
    ) -> None:
        """Fill ``scores[j].step_positions`` / ``.step_scores`` (process-reward heads)."""
        assert self.reward_model is not None and options.step is not None
        kind = head_kind(self.reward_model, self.reward_adapter)
        probs = step_scores(self.reward_model, kind, batch, ordered, options.step)
        for j, seq, row in zip(order, ordered, probs, strict=True):
            steps = seq.steps if seq.steps is not None else np.zeros(0, np.int64)
            scores[j].step_positions = steps.astype(np.int32)
            scores[j].step_scores = row.cpu().numpy().astype(np.float32)

    def _logprobs(
        self,
        batch: ForwardBatch,
        ordered: list[PreparedSequence],
        order: list[int],
        mode: Mode,
        temp: float,
        scores: list[SequenceScore],
        spec: TokenOutputs = LOGPS_ONLY,
        extra: dict[str, Any] | None = None,
    ) -> RewardOutput | None:
        """Fill ``scores[j].logps`` (and ``.arrays``, the teacher outputs ``spec`` asks for);
        returns the rewards when the shared adapter pooled them from the same hidden states."""
        model = self.reference_model
        assert model is not None
        rewarded = None
        hidden = backbone_hidden(model, batch, **(extra or {}))  # [R, T, H]: the one forward
        if mode == "both" and self.shared_adapter is not None:
            # One model, both surfaces: the reward head reads the same hidden states.
            rewarded = self.shared_adapter.from_hidden(model, batch, hidden)
        picked, labels, sizes = self._scored_rows(hidden, batch, ordered)
        del hidden  # the LM-head chunks below need only the scored rows
        head_spec = head_request(spec)  # None: only the hidden rows, no LM head at all
        arrays = (
            {}
            if head_spec is None
            else self.head_outputs(picked, labels, ordered, replace(head_spec, temperature=temp))
        )
        if "hidden" in spec.outputs and self.keeps_hidden:  # what the head read, as asked
            arrays["hidden"] = picked.to(HIDDEN_TORCH[spec.hidden_dtype])  # [N, H]
        del picked
        split = {name: torch.split(value, sizes) for name, value in arrays.items()}
        for k, j in enumerate(order):
            got = {name: parts[k] for name, parts in split.items()}
            if "logps" in got:
                scores[j].logps = self._host(got.pop("logps"))
            if spec != LOGPS_ONLY or ordered[k].aligned is not None:
                scores[j].arrays = {name: host_array(value) for name, value in got.items()}
            aligned, logps = ordered[k].aligned, scores[j].logps
            if aligned is not None and logps is not None:  # student text: the aligned spans
                spans = span_arrays(aligned, ordered[k].ids[ordered[k].scored], logps)
                scores[j].arrays = {**(scores[j].arrays or {}), **spans}
        return rewarded

    def head_outputs(
        self,
        picked: torch.Tensor,
        labels: torch.Tensor,
        ordered: list[PreparedSequence],
        spec: TokenOutputs,
    ) -> dict[str, torch.Tensor]:
        """The LM head over the scored rows ``picked`` ``[N, H]`` predicting ``labels`` ``[N]``:
        the arrays ``spec`` asks for (``spec.temperature`` is the call's), keyed as in
        ``head.teacher``, each ``[N, ...]``; ``ordered`` carries the per-position gather ids.
        Log-probs alone take the fast path (tiles on CPU, else whole-vocabulary blocks)."""
        model = self.reference_model
        assert model is not None
        head = model.get_output_embeddings()
        tile = self.config.vocab_tile(self.device.type) if tileable(head) else 0
        temp = spec.temperature
        if replace(spec, temperature=1.0) == LOGPS_ONLY:
            # CPU: [rows, tile] slices reduced in cache; else whole-vocabulary blocks
            by = (
                partial(tiled_token_logps, tile=tile, native_ok=self.config.native_head)
                if tile
                else chunked_token_logps
            )
            logps = by(
                picked,
                head,
                labels,
                temperature=temp,
                chunk_tokens=self._chunk_rows(head, 1.0 if _f32(head) else 1.5, tile or None),
                transform=self.transform,
            )  # [N]
            return {"logps": logps}
        gather = None
        if spec.gather_width:
            rows = [s.gather_ids for s in ordered]
            assert all(r is not None for r in rows)
            gather = torch.from_numpy(np.concatenate(rows)).to(self.device)  # type: ignore[arg-type]
        vocab = int(getattr(head, "out_features", 0)) or self.vocab_size
        tiled = tile and spec.sampling is None and "rank" not in spec.outputs
        width = tile if tiled else vocab  # the blocks' columns
        return chunked_token_outputs(
            picked,
            head,
            labels,
            spec,
            transform=self.transform,
            gather_ids=gather,  # [N, K] | None
            chunk_rows=self._chunk_rows(head, block_units(spec, vocab, not _f32(head)), width),
            vocab_tile=tile,
            native_ok=self.config.native_head,
        )

    def _chunk_rows(self, head: Any, units: float, vocab: int | None = None) -> int:
        """Rows per LM-head block: ``units`` float32 ``[rows, V]`` blocks within
        ``logprob_chunk_bytes``, at most ``logprob_chunk_tokens``."""
        vocab = vocab or int(getattr(head, "out_features", 0)) or self.vocab_size
        by_bytes = chunk_rows_for(vocab, self.config.logprob_chunk_bytes, units)
        return min(self.config.logprob_chunk_tokens, by_bytes)

    def _scored_rows(
        self, hidden: torch.Tensor, batch: ForwardBatch, seqs: list[PreparedSequence]
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Hidden states ``[N, H]`` of the positions that predict a scored token, their labels
        ``[N]`` and the number of scored tokens per sequence, batch order."""
        scored = [s.scored for s in seqs if s.scored is not None]
        assert len(scored) == len(seqs)
        where = batch.flat_index([p - 1 for p in scored])
        labels = np.concatenate([s.ids[p] for s, p in zip(seqs, scored, strict=True)])
        picked = gather_flat(hidden, torch.from_numpy(where).to(self.device))  # [N, H]
        sizes = [len(p) for p in scored]
        return picked, torch.from_numpy(labels).to(self.device), sizes

    def _host(self, values: torch.Tensor) -> np.ndarray:
        """A result tensor as a host array of the configured output dtype."""
        return values.cpu().numpy().astype(self.out_dtype, copy=False)


def pooled(
    adapter: RewardAdapter, model: Any, batch: ForwardBatch, extra: dict[str, Any], mode: Mode
) -> RewardOutput:
    """``adapter``'s rewards of reward ``model`` over ``batch``; a ``reward`` batch's image
    inputs ``extra`` (the reward model's ``mm_encoder_outputs``, token types) reach its backbone
    and its hidden states are pooled (``from_hidden``: intake sends images only to a
    ``HiddenStateRewardAdapter``)."""
    if not extra or mode != "reward":
        return adapter(model, batch)
    assert isinstance(adapter, HiddenStateRewardAdapter)
    return adapter.from_hidden(model, batch, backbone_hidden(model, batch, **extra))


def vision_of(model: Any) -> Any:
    """The ``VisionModel`` of a reward ``model`` served with images, ``None`` for a text-only
    one or an image-text class not served with images (it still scores text)."""
    if model is None:
        return None
    try:
        return vision_model(model)
    except ConfigError:
        return None


def _f32(head: Any) -> bool:
    """Whether the LM head computes in float32 (else ``float()`` adds a half-size copy)."""
    weight = getattr(head, "weight", None)
    return weight is None or weight.dtype == torch.float32
