"""Process-reward heads: one score per reasoning step, read at each step position.

Two head kinds, chosen by the reward checkpoint's architecture (``head_kind``):

* ``token-classification`` (``*ForTokenClassification`` with 2 labels, e.g. Qwen2.5-Math-PRM):
  the step score is ``softmax(head(h_t))[positive_index]`` at each step position ``t``.
  Naive equivalent: ``model(input_ids).logits[0, t].double().softmax(-1)[positive_index]``.
* ``lm-label`` (a ``*ForCausalLM``, e.g. Math-Shepherd): the step score is
  ``softmax([z_good, z_bad])[0]`` where ``z`` are the LM-head logits at ``t`` (after the
  model's logit transform). Naive equivalent:
  ``model(input_ids).logits[0, t, [good, bad]].double().softmax(-1)[0]``.

Only the step positions go through a head (``[N, H]`` rows; the LM-label head uses just the two
label rows of the LM-head weight), so a step job costs one backbone forward.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from worker.errors import ConfigError
from worker.executor.head.logprobs import logit_transform_for
from worker.executor.packing import ForwardBatch, gather_flat
from worker.executor.rewards.pooling import backbone_hidden
from worker.scorer.inputs import PreparedSequence
from worker.scorer.steps import StepOptions

HeadKind = Literal["sequence", "token-classification", "lm-label"]
HEAD_KINDS: tuple[str, ...] = ("auto", "sequence", "token-classification", "lm-label")
STEP_HEADS = ("token-classification", "lm-label")


def head_kind(model: nn.Module, adapter: Any) -> HeadKind:
    """How a reward model is read: a process-reward head when the model is a token classifier
    or a causal LM and no custom adapter is given (``adapter`` is ``None`` or the default
    sequence-classification reader); else ``sequence`` (a reward per sequence)."""
    from worker.executor.rewards.pooling import SequenceClassificationAdapter

    if adapter is not None and type(adapter) is not SequenceClassificationAdapter:
        return "sequence"
    name = type(model).__name__
    if name.endswith("ForTokenClassification"):
        return "token-classification"
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "lm-label"
    return "sequence"


def check_token_head(model: nn.Module) -> None:
    """``ConfigError`` unless ``model`` is a 2-label token classifier with a head."""
    labels = getattr(getattr(model, "config", None), "num_labels", None)
    if labels != 2:
        raise ConfigError(
            f"process reward model {type(model).__name__} has num_labels={labels}; a "
            "token-classification step head needs 2 labels"
        )
    _token_head(model)


def _token_head(model: nn.Module) -> nn.Module:
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return head
    raise ConfigError(f"{type(model).__name__} has no token-classification head")


def step_scores(
    model: Any,
    kind: HeadKind,
    batch: ForwardBatch,
    seqs: list[PreparedSequence],
    step: StepOptions,
) -> list[torch.Tensor]:
    """Step scores ``[k_i]`` float32 of every sequence of ``batch`` (``seqs`` in batch order),
    one backbone forward."""
    sizes = [0 if s.steps is None else len(s.steps) for s in seqs]
    if sum(sizes) == 0:
        return [torch.zeros(0) for _ in seqs]
    none = np.zeros(0, dtype=np.int64)
    where = batch.flat_index([none if s.steps is None else s.steps for s in seqs])
    hidden = backbone_hidden(model, batch)  # [R, T, H]
    picked = gather_flat(hidden, torch.from_numpy(where).to(hidden.device))  # [N, H]
    if kind == "token-classification":
        head = _token_head(model)
        param = next(head.parameters())
        logits = head(picked.to(param.dtype)).float()  # [N, 2]
        probs = logits.softmax(-1)[:, step.positive_index]  # [N]
    elif kind == "lm-label":
        if step.label_token_ids is None:
            raise ConfigError("an LM-label step head needs label_token_ids")  # checked earlier
        lm = model.get_output_embeddings()
        rows = torch.tensor(step.label_token_ids, device=lm.weight.device)
        bias = lm.bias.index_select(0, rows) if getattr(lm, "bias", None) is not None else None
        weight = lm.weight.index_select(0, rows)  # [2, H]
        logits = F.linear(picked.to(weight.dtype), weight, bias).float()  # [N, 2]
        logit_transform_for(model).apply_(logits)
        probs = logits.softmax(-1)[:, 0]  # [N]
    else:
        raise ConfigError(f"reward head {kind!r} has no step scores")
    return list(torch.split(probs, sizes))
