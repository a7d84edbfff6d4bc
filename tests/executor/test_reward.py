"""Reward pooling at the true last token, value-head adapters, and `both` mode."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.support.models import random_tokens, tiny_backbone, tiny_causal, tiny_reward
from worker.errors import BadRequest, ConfigError
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.executor.rewards.pooling import ValueHeadAdapter

LENGTHS = (9, 21, 4, 14)


def _seqs(seed: int = 0, eos_last: bool = True) -> list[SequenceInput]:
    out = []
    for i, n in enumerate(LENGTHS):
        tokens = random_tokens(n, seed + i)
        if eos_last:
            tokens[-1] = 0  # eos == pad: a pad_token_id search would pool the wrong token
        out.append(SequenceInput(tokens, prompt_len=2))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("packing", ["packed", "padded", "rows"])
def test_reward_equals_hf_pooled_logit(arch: str, packing: str) -> None:
    model = tiny_reward(arch)
    config = (
        ExecutorConfig(mode="reward", packing="packed", packed_row_tokens=16)  # several rows
        if packing == "rows"
        else ExecutorConfig(mode="reward", packing=packing)  # type: ignore[arg-type]
    )
    ex = StatelessExecutor(config, reward_model=model)
    seqs = _seqs(eos_last=False)
    got = [s.reward for s in ex.score(seqs).scores]
    # HF's own pooling on a right-padded batch (pad id 0 never occurs inside these sequences).
    width = max(len(s.tokens) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s.tokens)] = torch.tensor(s.tokens)
        mask[i, : len(s.tokens)] = 1
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits[:, 0].double().numpy()
    assert np.abs(np.array(got) - want).max() <= 1e-4


def test_reward_pools_true_last_token_when_pad_equals_eos() -> None:
    model = tiny_reward("llama")
    ex = StatelessExecutor(ExecutorConfig(mode="reward"), reward_model=model)
    seqs = _seqs(eos_last=True)
    got = [s.reward for s in ex.score(seqs).scores]
    for s, r in zip(seqs, got, strict=True):
        with torch.no_grad():
            hidden = model.model(input_ids=torch.tensor(s.tokens)[None]).last_hidden_state
            want = float(model.score(hidden[0, -1]))
        assert r == pytest.approx(want, abs=1e-4)


def test_reward_mode_needs_no_prompt_len() -> None:
    ex = StatelessExecutor(ExecutorConfig(mode="reward"), reward_model=tiny_reward("llama"))
    out = ex.score([SequenceInput(random_tokens(7, 1)), SequenceInput([3])])
    assert all(s.reward is not None and s.logps is None for s in out.scores)
    assert out.metrics.scored_tokens == 0


def test_both_mode_with_two_models() -> None:
    ref, rew = tiny_causal("llama"), tiny_reward("qwen2")
    both = StatelessExecutor(ExecutorConfig(mode="both"), ref, rew)
    assert both.modes == ("reference", "reward", "both")
    seqs = _seqs(seed=4)
    out = both.score(seqs).scores
    only_ref = StatelessExecutor(ExecutorConfig(), ref).score(seqs).scores
    only_rew = StatelessExecutor(ExecutorConfig(mode="reward"), reward_model=rew).score(seqs).scores
    for a, b, c in zip(out, only_ref, only_rew, strict=True):
        assert np.abs(a.logps - b.logps).max() <= 1e-5
        assert a.reward == pytest.approx(c.reward, abs=1e-5)
    # per-call mode override on the same executor
    assert both.score(seqs, mode="reward").scores[0].logps is None


def test_one_model_both_surfaces_through_value_head() -> None:
    """A causal LM plus a value head on its own backbone serves logps and rewards."""
    ref = tiny_causal("llama")
    torch.manual_seed(3)
    head = torch.nn.Linear(32, 1)
    ex = StatelessExecutor(ExecutorConfig(mode="both"), ref, reward_adapter=ValueHeadAdapter(head))
    seqs = _seqs(seed=8)
    out = ex.score(seqs).scores
    for s, score in zip(seqs, out, strict=True):
        with torch.no_grad():
            hidden = ref.model(input_ids=torch.tensor(s.tokens)[None]).last_hidden_state
            want = float(head(hidden[0, -1]))
        assert score.reward == pytest.approx(want, abs=1e-5)
        assert score.logps is not None


def test_value_head_on_bare_backbone_with_token_scores() -> None:
    base = tiny_backbone("gpt2")
    torch.manual_seed(4)
    head = torch.nn.Linear(32, 1)
    ex = StatelessExecutor(
        ExecutorConfig(mode="reward"),
        reward_model=base,
        reward_adapter=ValueHeadAdapter(head, token_level=True),
    )
    seqs = _seqs(seed=2)
    out = ex.score(seqs).scores
    for s, score in zip(seqs, out, strict=True):
        with torch.no_grad():
            hidden = base(input_ids=torch.tensor(s.tokens)[None]).last_hidden_state[0]
            want = head(hidden)[:, 0].numpy()
        assert score.token_scores is not None and score.token_scores.shape == (len(s.tokens),)
        assert np.abs(score.token_scores - want).max() <= 1e-5
        assert score.reward == pytest.approx(float(want[-1]), abs=1e-5)


def test_reward_head_checks() -> None:
    # A multi-objective head serves any index it has; an index past its outputs is refused.
    with pytest.raises(ConfigError, match="outside the reward head's 2 outputs"):
        StatelessExecutor(
            ExecutorConfig(mode="reward", reward_index=2), reward_model=tiny_reward(num_labels=2)
        )
    # A causal LM as the reward model is an LM-label process reward model, never a random
    # sequence head: a plain reward job is refused.
    lm = StatelessExecutor(ExecutorConfig(mode="reward"), reward_model=tiny_causal("llama"))
    assert lm.info["reward_head"] == "lm-label"
    with pytest.raises(BadRequest, match="LM-label process reward model"):
        lm.score([SequenceInput(random_tokens(5, 0))])


class _TwoPass:
    """Wraps an adapter but hides ``from_hidden``: the executor must run the backbone again."""

    def __init__(self, inner: ValueHeadAdapter) -> None:
        self.inner = inner
        self.token_level = inner.token_level

    def __call__(self, model: torch.nn.Module, batch: Any) -> Any:
        return self.inner(model, batch)


def _count_forwards(module: torch.nn.Module) -> list[int]:
    calls = [0]

    def hook(*_: Any) -> None:
        calls[0] += 1

    module.register_forward_hook(hook)
    return calls


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"packing": "padded"},
        {"packing": "packed", "packed_row_tokens": 16},
        {"max_batch_tokens": 24},
    ],
)
@pytest.mark.parametrize("token_level", [False, True])
def test_one_model_both_surfaces_runs_the_backbone_once(
    config: dict[str, Any], token_level: bool
) -> None:
    """mode="both" with one model + adapter: one backbone forward per batch, same numbers as
    the two-pass path (reward adapter running its own forward)."""
    ref = tiny_causal("llama")
    torch.manual_seed(3)
    adapter = ValueHeadAdapter(torch.nn.Linear(32, 1), token_level=token_level)
    cfg = ExecutorConfig(mode="both", **config)
    one = StatelessExecutor(cfg, ref, reward_adapter=adapter)
    two = StatelessExecutor(cfg, ref, reward_adapter=_TwoPass(adapter))
    backbone, whole = _count_forwards(ref.model), _count_forwards(ref)
    seqs = _seqs(seed=8)

    fast = one.score(seqs)
    assert fast.metrics.forwards >= 1
    assert backbone[0] == fast.metrics.forwards and whole[0] == 0
    backbone[0] = 0
    slow = two.score(seqs)
    assert slow.metrics.forwards == fast.metrics.forwards
    assert backbone[0] == 2 * slow.metrics.forwards

    for a, b in zip(fast.scores, slow.scores, strict=True):
        assert a.logps is not None and b.logps is not None
        assert np.array_equal(a.logps, b.logps)
        assert a.reward is not None and a.reward == b.reward
        if token_level:
            assert a.token_scores is not None and b.token_scores is not None
            assert np.array_equal(a.token_scores, b.token_scores)
        else:
            assert a.token_scores is None
    # the other modes of the same executor still run the backbone once per batch
    for mode in ("reference", "reward"):
        backbone[0] = 0
        out = one.score(seqs, mode=mode)
        assert backbone[0] == out.metrics.forwards


def test_two_models_still_run_one_forward_each() -> None:
    ref, rew = tiny_causal("llama"), tiny_reward("qwen2")
    ex = StatelessExecutor(ExecutorConfig(mode="both", packing="packed"), ref, rew)
    ref_calls, rew_calls = _count_forwards(ref.model), _count_forwards(rew.model)
    out = ex.score(_seqs(seed=4))
    assert ref_calls[0] == rew_calls[0] == out.metrics.forwards == 1
