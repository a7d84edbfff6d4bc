"""The reward side of a call beyond the forward: which head reads the reward model, the reward
model's own tokenizer and chat template (``messages``, ``text``), and the calls a ``score`` runs.

``RewardSurface`` is fixed at construction: the head kind (``sequence``, or a process-reward
head: ``token-classification`` / ``lm-label``, see ``steps``), the reward model's tokenizer,
whether its token ids mean what the reference model's do, its vocabulary and positions, and the
names of a multi-objective head's outputs. ``prepare`` renders ``messages`` and tokenizes
``text`` once (at intake); ``reward_inputs`` checks what the reward model reads (the request's
plan is ``worker.executor.call.plan_calls``); ``merge_outputs`` joins the outputs of a
``reference`` and a ``reward`` call over the same sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from worker.errors import BadRequest, ConfigError, TooLong
from worker.executor.rewards.chat import encode, render, same_vocabulary
from worker.executor.rewards.pooling import RewardAdapter, SequenceClassificationAdapter
from worker.executor.rewards.steps import STEP_HEADS, HeadKind, check_token_head, head_kind
from worker.modes import REWARD_MODES, Mode
from worker.request import ScoreOptions
from worker.scorer.inputs import PreparedSequence, SequenceInput, prepare_sequence
from worker.scorer.outputs import ScoreOutput
from worker.scorer.steps import step_positions


def resolve_head(
    model: Any, adapter: RewardAdapter | None, reward_index: int
) -> tuple[HeadKind, RewardAdapter | None]:
    """The head kind of reward ``model`` and the adapter that reads a sequence reward (``None``
    for a process-reward head); ``ConfigError`` when the model cannot be read so."""
    if model is None:
        return "sequence", adapter
    kind = head_kind(model, adapter)
    if kind == "token-classification":
        check_token_head(model)
        return kind, None
    if kind == "lm-label":
        if model.get_output_embeddings() is None:
            raise ConfigError(f"{type(model).__name__} has no LM head")
        return kind, None
    if adapter is None:
        adapter = SequenceClassificationAdapter(reward_index=reward_index)
    if type(adapter) is SequenceClassificationAdapter:  # the model's own head: its index/weights
        SequenceClassificationAdapter.check(model, adapter.reward_index, adapter.reward_weights)
    return kind, adapter


@dataclass(frozen=True)
class RewardSurface:
    """What reward calls need besides the forward (see the module docstring)."""

    head: HeadKind = "sequence"
    tokenizer: Any = None
    same_vocab: bool | None = None  # None: unknown (a checkpoint without a tokenizer)
    vocab: int = 0
    limit: int | None = None
    objectives: tuple[str, ...] | None = None

    def info(self) -> dict[str, Any]:
        """``reward_head`` and, for a multi-objective head, ``reward_objectives``."""
        out: dict[str, Any] = {"reward_head": self.head}
        if self.objectives:
            out["reward_objectives"] = list(self.objectives)
        return out

    def check_call(self, mode: Mode, options: ScoreOptions) -> None:
        """``BadRequest`` when this reward model cannot serve ``mode`` with ``options``."""
        step = options.step
        if mode not in REWARD_MODES:
            if step is not None:
                raise BadRequest("a step job needs mode 'reward'")
            return
        if step is not None:
            if mode != "reward":
                raise BadRequest("a step job needs mode 'reward'")
            if self.head not in STEP_HEADS:
                raise BadRequest(
                    "step scores need a process reward model (a *ForTokenClassification or a "
                    f"*ForCausalLM reward checkpoint); this reward model has a {self.head} head"
                )
            if self.head == "lm-label" and step.label_token_ids is None:
                raise BadRequest("this LM-label process reward model needs step.label_token_ids")
            step.check(self.vocab)
        elif self.head == "lm-label":
            raise BadRequest(
                "the reward model is a causal LM, served only as an LM-label process reward "
                "model: send a step map with tag_id (or step_positions) and label_token_ids"
            )
        elif self.head == "token-classification":
            raise BadRequest(
                "the reward model is a token-classification process reward model: send a step "
                "map with tag_id (or step_positions)"
            )

    def prepare(
        self, seqs: Sequence[SequenceInput], mode: Mode, options: ScoreOptions
    ) -> list[SequenceInput]:
        """``seqs`` with every ``messages`` rendered and every ``text`` tokenized into ``rm_ids``
        (once); checks the call and the reward inputs (``BadRequest`` / ``TooLong`` naming the
        sequence)."""
        if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Sequence):
            raise BadRequest(f"expected a list of SequenceInput, got {type(seqs).__name__}")
        self.check_call(mode, options)
        out = []
        for i, seq in enumerate(seqs):
            if isinstance(seq, SequenceInput) and untokenized(seq):
                what = "messages" if seq.messages is not None else "text"
                if mode not in REWARD_MODES:
                    raise BadRequest(f"sequence {i}: {what} is scored in modes reward, both")
                if seq.rm_ids is None:
                    try:
                        seq = replace(seq, rm_ids=self._rm_ids(seq))
                    except BadRequest as exc:
                        raise BadRequest(f"sequence {i}: {exc.message}") from None
            out.append(seq)
        return out

    def _rm_ids(self, seq: SequenceInput) -> np.ndarray:
        """The reward model's ids of an untokenized sequence: its chat template over
        ``messages``, or its tokenizer over ``text``."""
        if seq.messages is not None:
            return render(self.tokenizer, seq.messages)
        return encode(self.tokenizer, seq.text)

    def reward_inputs(
        self, seqs: Sequence[SequenceInput], options: ScoreOptions
    ) -> list[PreparedSequence]:
        """The reward model's inputs: rendered ids for ``messages``, else ``tokens`` (refused
        when the two models' tokenizers differ); step positions for a step job."""
        out = []
        for i, seq in enumerate(seqs):
            try:
                out.append(self._reward_input(seq, options))
            except (BadRequest, TooLong) as exc:
                raise type(exc)(f"sequence {i}: {exc.message}") from None
        return out

    def _reward_input(self, seq: SequenceInput, options: ScoreOptions) -> PreparedSequence:
        if not untokenized(seq):
            if self.same_vocab is False:
                raise BadRequest(
                    "the reward model's tokenizer differs from the reference model's, so token "
                    "ids mean other text to it: send the conversation as messages"
                )
            prepared = prepare_sequence(seq, self.vocab, self.limit, needs_scored=False)
            prepared = replace(prepared, scored=None)
        else:
            ids = seq.rm_ids if seq.rm_ids is not None else self._rm_ids(seq)
            ids = np.asarray(ids, dtype=np.int64)
            if self.limit is not None and ids.size > self.limit:
                what = "messages render" if seq.messages is not None else "text tokenizes"
                raise TooLong(
                    f"{what} to {ids.size} reward-model tokens, over its {self.limit} positions"
                )
            if ids.size and (ids.min() < 0 or ids.max() >= self.vocab):
                raise BadRequest(f"rendered token ids outside [0, {self.vocab})")
            prepared = PreparedSequence(ids=ids, scored=None, rm_tokens=int(ids.size))
        if options.step is not None:
            steps = step_positions(prepared.ids, seq.step_positions, options.step)
            prepared = replace(prepared, steps=steps)
        return prepared


def untokenized(seq: SequenceInput) -> bool:
    """Whether the reward model tokenizes this sequence itself (``messages`` or ``text``)."""
    return seq.messages is not None or seq.text is not None


def reward_surface(
    model: Any, head: HeadKind, tokenizers: tuple[Any, Any] | None, forward: Any
) -> RewardSurface:
    """The ``RewardSurface`` of reward ``model`` read by ``head``; ``tokenizers``: the reference
    and the reward model's tokenizers (either may be ``None``), compared when both models are
    served and distinct."""
    if model is None:
        return RewardSurface()
    ref_tok, rm_tok = tokenizers or (None, None)
    ref = forward.reference_model
    same = True if ref is None or ref is model else same_vocabulary(ref_tok, rm_tok)
    config = getattr(model, "config", None)
    limit = None
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            limit = value
            break
    objectives = None
    labels = getattr(config, "num_labels", 1)
    if head == "sequence" and isinstance(labels, int) and labels > 1:
        id2label = getattr(config, "id2label", None) or {}
        objectives = tuple(str(id2label.get(k, f"LABEL_{k}")) for k in range(labels))
    return RewardSurface(
        head=head,
        tokenizer=rm_tok,
        same_vocab=same,
        vocab=int(model.get_input_embeddings().weight.shape[0]),
        limit=limit,
        objectives=objectives,
    )


def merge_outputs(outputs: list[ScoreOutput]) -> ScoreOutput:
    """One output from a ``reference`` and a ``reward`` call over the same sequences: log-probs
    (and teacher arrays) from the first, the reward fields from the second, summed costs."""
    if len(outputs) == 1:
        return outputs[0]
    ref, rew = outputs
    scores = []
    for a, b in zip(ref.scores, rew.scores, strict=True):
        scores.append(
            replace(
                b,
                logps=a.logps,
                arrays=getattr(a, "arrays", None),
                error=a.error if a.error is not None else b.error,
                shared_tokens=a.shared_tokens + b.shared_tokens,
            )
        )
    m, n = ref.metrics, rew.metrics
    metrics = replace(
        m,
        real_tokens=m.real_tokens + n.real_tokens,
        padded_tokens=m.padded_tokens + n.padded_tokens,
        elapsed_s=max(m.elapsed_s, n.elapsed_s),
        forward_s=m.forward_s + n.forward_s,
        backend=n.backend,
        fallbacks=m.fallbacks + n.fallbacks,
        kv_output_tensors=m.kv_output_tensors + n.kv_output_tensors,
        kv_output_bytes=m.kv_output_bytes + n.kv_output_bytes,
        oom_splits=m.oom_splits + n.oom_splits,
        packed=m.packed or n.packed,
        forwards=m.forwards + n.forwards,
        packed_fill_tokens=m.packed_fill_tokens + n.packed_fill_tokens,
        forward_tokens=m.forward_tokens + n.forward_tokens,
        shared_prefix_tokens=m.shared_prefix_tokens + n.shared_prefix_tokens,
    )
    return ScoreOutput(scores=scores, metrics=metrics)


__all__ = ["RewardSurface", "merge_outputs", "resolve_head", "reward_surface", "untokenized"]
