"""Reward heads: pooling at each sequence's true last token, behind a small adapter protocol.

The pooled position is ``start + length - 1`` of every sequence (its real length, from the batch
layout), never a search for ``pad_token_id``: that search breaks when pad == eos and is
meaningless in a packed row. Naive equivalent: the HF ``*ForSequenceClassification`` forward on
one unpadded sequence, ``model(input_ids).logits[0, 0]``; ``tests/executor/test_reward.py``
asserts they agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from worker.errors import ConfigError
from worker.executor.packing import ForwardBatch, gather_flat


@dataclass
class RewardOutput:
    """What an adapter returns for one batch, in batch order."""

    rewards: torch.Tensor  # [B] float32
    token_scores: list[torch.Tensor] | None = None  # B x [L_i] float32, when token_level
    objectives: torch.Tensor | None = None  # [B, K] float32, when the head has K > 1 outputs


@runtime_checkable
class RewardAdapter(Protocol):
    """Turns one forward batch into one reward per sequence (and optionally one per token).

    ``token_level``: when true, the adapter also returns a score for every token of every
    sequence (``RewardOutput.token_scores``); the executor hands them out as
    ``SequenceScore.token_scores``.
    """

    token_level: bool

    def __call__(self, model: nn.Module, batch: ForwardBatch) -> RewardOutput:
        """Run ``model`` on ``batch`` (``use_cache=False``) and pool the rewards."""
        ...


@runtime_checkable
class HiddenStateRewardAdapter(RewardAdapter, Protocol):
    """A ``RewardAdapter`` that can also pool hidden states the executor already has.

    When one model serves both surfaces (``mode="both"``, reward through an adapter on the
    reference model), the executor runs that model's backbone once and hands the hidden states to
    ``from_hidden`` instead of calling the adapter (which would run the backbone a second time).
    """

    def from_hidden(
        self, model: nn.Module, batch: ForwardBatch, hidden: torch.Tensor
    ) -> RewardOutput:
        """Pool rewards from ``hidden`` ``[R, T, H]`` = ``backbone_hidden(model, batch)``."""
        ...


def backbone_of(model: nn.Module) -> nn.Module:
    """The transformer body of a transformers model (``model.base_model``), else ``model``."""
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) else model


def backbone_hidden(model: nn.Module, batch: ForwardBatch, **extra: Any) -> torch.Tensor:
    """Last hidden states ``[R, T, H]`` of ``model``'s backbone, one ``use_cache=False`` forward
    (``extra``: more inputs, e.g. a vision-language model's ``mm_encoder_outputs``; an
    ``attention_mask`` there replaces the batch's)."""
    tree = {} if batch.tree is None else {"scoring_tree": batch.tree}  # tree rows' structure
    mask = extra.pop("attention_mask", batch.attention_mask)  # Gemma-3's packed image masks
    out = backbone_of(model)(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        attention_mask=mask,
        use_cache=False,
        **tree,
        **extra,
    )
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None:
        hidden = out[0]
    return hidden  # [R, T, H]


def token_index(batch: ForwardBatch) -> torch.Tensor:
    """Flat indices of every real token of every sequence, batch order, ``[sum L]``."""
    if batch.tree is not None:  # a shared segment's tokens are read once per sequence
        where = batch.flat_index([np.arange(n) for n in batch.lengths.tolist()])
        return torch.from_numpy(where).to(batch.starts.device)
    offsets = torch.repeat_interleave(batch.starts, batch.lengths)  # [S]
    firsts = torch.repeat_interleave(
        torch.cumsum(batch.lengths, 0) - batch.lengths, batch.lengths
    )  # [S]
    return offsets + torch.arange(offsets.numel(), device=offsets.device) - firsts  # [S]


def _as_head_input(hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
    """``hidden`` on the head's device and dtype (a value head may be kept in float32)."""
    param = next(head.parameters(), None)
    if param is None:
        return hidden
    return hidden.to(device=param.device, dtype=param.dtype)


def check_reward_weights(
    weights: Sequence[float] | None, reward_index: int = 0
) -> tuple[float, ...] | None:
    """``weights`` as a tuple of finite floats (None stays None); ``ConfigError`` when empty,
    not numbers, or given with a ``reward_index`` other than 0 (the two are exclusive)."""
    if weights is None:
        return None
    if isinstance(weights, (str, bytes)):
        raise ConfigError("--reward-weights must be a list of numbers")
    try:
        out = tuple(float(w) for w in weights)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"--reward-weights must be numbers: {exc}") from None
    if not out or not all(math.isfinite(w) for w in out):
        raise ConfigError("--reward-weights must be one finite number per head output")
    if reward_index != 0:
        raise ConfigError("--reward-weights and --reward-index are exclusive: give one")
    return out


class HeadAdapter:
    """Backbone hidden states -> a ``[H] -> [K]`` head, read at each sequence's last token.

    The reward is output ``reward_index`` (default 0), or with ``reward_weights`` ``[K]`` the
    linear combination ``outputs @ reward_weights`` (float32); a head with ``K > 1`` outputs (a
    multi-objective reward model) also returns all ``K`` (``RewardOutput.objectives``).
    """

    def __init__(
        self,
        token_level: bool = False,
        reward_index: int = 0,
        reward_weights: Sequence[float] | None = None,
    ) -> None:
        self.token_level = token_level
        self.reward_index = reward_index
        # multi-objective heads: a documented linear combination instead of one output
        self.reward_weights = check_reward_weights(reward_weights, reward_index)

    def _pick(self, outputs: torch.Tensor) -> torch.Tensor:
        """``[N, K]`` head outputs -> ``[N]`` rewards: output ``reward_index``, or
        ``outputs @ reward_weights``. Naive equivalent: ``sum_k w_k * outputs[:, k]`` in float64."""
        if self.reward_weights is None:
            return outputs[:, self.reward_index]  # [N]
        if outputs.shape[1] != len(self.reward_weights):
            raise ConfigError(
                f"--reward-weights has {len(self.reward_weights)} weights for a reward head "
                f"with {outputs.shape[1]} outputs"
            )
        w = torch.tensor(self.reward_weights, dtype=outputs.dtype, device=outputs.device)  # [K]
        return outputs @ w  # [N]

    def head(self, model: nn.Module) -> nn.Module:
        """The scalar head to apply on hidden states ``[N, H] -> [N, 1]``."""
        raise NotImplementedError

    def __call__(self, model: nn.Module, batch: ForwardBatch) -> RewardOutput:
        return self.from_hidden(model, batch, backbone_hidden(model, batch))

    def from_hidden(
        self, model: nn.Module, batch: ForwardBatch, hidden: torch.Tensor
    ) -> RewardOutput:
        """Rewards (and token scores) from the backbone's hidden states ``[R, T, H]``."""
        head = self.head(model)
        last = _as_head_input(gather_flat(hidden, batch.last_index), head)  # [B, H]
        outputs = head(last).float().reshape(len(batch.seq_ids), -1)  # [B, K]
        rewards = self._pick(outputs)  # [B]
        token_scores = None
        if self.token_level:
            every = _as_head_input(gather_flat(hidden, token_index(batch)), head)  # [S, H]
            flat = self._pick(head(every).float().reshape(every.shape[0], -1))  # [S]
            token_scores = list(torch.split(flat, batch.lengths.tolist()))
        objectives = outputs if outputs.shape[1] > 1 else None
        return RewardOutput(rewards=rewards, token_scores=token_scores, objectives=objectives)


class SequenceClassificationAdapter(HeadAdapter):
    """Default adapter for ``*ForSequenceClassification`` reward models.

    Uses the model's own head (``score``, or ``classifier`` for architectures that name it so).
    With ``num_labels > 1`` (multi-objective), the reward is label ``reward_index`` and every
    label's output comes back as ``objectives``.
    """

    HEAD_NAMES = ("score", "classifier")

    def head(self, model: nn.Module) -> nn.Module:
        for name in self.HEAD_NAMES:
            head = getattr(model, name, None)
            if isinstance(head, nn.Module):
                return head
        raise ConfigError(
            f"{type(model).__name__} has no reward head ({' / '.join(self.HEAD_NAMES)}); "
            "pass a reward_adapter for this model"
        )

    @staticmethod
    def check(
        model: nn.Module, reward_index: int = 0, reward_weights: Sequence[float] | None = None
    ) -> None:
        """Raise ``ConfigError`` unless ``model`` is a sequence classifier with a label
        ``reward_index`` (or one weight per label in ``reward_weights``)."""
        config: Any = getattr(model, "config", None)
        labels = getattr(config, "num_labels", None)
        if not isinstance(labels, int) or labels < 1:
            raise ConfigError(
                f"reward model {type(model).__name__} has num_labels={labels}; a reward head "
                "needs num_labels >= 1 (or pass a reward_adapter)"
            )
        if not 0 <= reward_index < labels:
            raise ConfigError(
                f"--reward-index {reward_index} is outside the reward head's {labels} outputs"
            )
        if reward_weights is not None and len(reward_weights) != labels:
            raise ConfigError(
                f"--reward-weights has {len(reward_weights)} weights; the reward head has "
                f"{labels} outputs (one weight each)"
            )
        SequenceClassificationAdapter().head(model)


class ValueHeadAdapter(HeadAdapter):
    """A separate value head (e.g. ``nn.Linear(H, 1)``) on any model's backbone.

    Works with a bare ``*Model``, a ``*ForCausalLM`` (so one model can serve both log-probs and
    rewards), or anything whose ``base_model`` returns ``last_hidden_state``.
    """

    def __init__(
        self,
        value_head: nn.Module,
        token_level: bool = False,
        reward_index: int = 0,
        reward_weights: Sequence[float] | None = None,
    ) -> None:
        super().__init__(token_level, reward_index, reward_weights)
        self.value_head = value_head

    def head(self, model: nn.Module) -> nn.Module:
        param = next(model.parameters(), None)
        if param is not None:
            self.value_head.to(param.device)  # no-op when already there
        return self.value_head
