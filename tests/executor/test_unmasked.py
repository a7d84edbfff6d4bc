"""Unmasked buckets (right pads, no attention mask) give what each sequence alone gives.

Pads sit after every real token of their row, so causal attention keeps them out of every scored
position and of the true last token that reward pooling reads. A bidirectional model breaks that:
the load probe must see it and fall back to masked buckets.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.models import ARCHS, random_model, random_tokens, tiny_causal, tiny_reward
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.executor.rewards.pooling import ValueHeadAdapter

LENGTHS = (12, 30, 5, 19, 2, 27)
# A pad fraction of 1 puts every sequence in one bucket, so most rows do carry right pads.
UNMASKED = ExecutorConfig(packing="unmasked", bucket_pad_fraction=1.0)


def _seqs(seed: int = 0, eos_last: bool = False) -> list[SequenceInput]:
    out = []
    for i, n in enumerate(LENGTHS):
        tokens = random_tokens(n, seed + i)
        if eos_last:
            tokens[-1] = 0  # eos == pad: the pads look like the last real token
        out.append(SequenceInput(tokens, prompt_len=max(1, n // 3)))
    return out


def _naive_logps(model: torch.nn.Module, s: SequenceInput) -> np.ndarray:
    """float64 log_softmax of the model's own logits on the sequence alone, scored part."""
    ids = torch.tensor(s.tokens)[None]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].double()  # [L, V]
    pos = torch.arange(int(s.prompt_len or 1), len(s.tokens))
    return torch.log_softmax(logits, -1)[pos - 1, ids[0, pos]].numpy()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_unmasked_bucket_logps_equal_one_by_one(arch: str, backend: str) -> None:
    model = tiny_causal(arch)
    config = ExecutorConfig(packing="unmasked", bucket_pad_fraction=1.0, attention_backend=backend)
    ex = StatelessExecutor(config, model)
    assert ex.layout == "unmasked" and ex.load_fallbacks == []
    seqs = _seqs(seed=3)
    out = ex.score(seqs)
    assert out.metrics.forwards == 1 and not out.metrics.packed
    assert out.metrics.padded_tokens == len(LENGTHS) * max(LENGTHS) - sum(LENGTHS)
    for s, score in zip(seqs, out.scores, strict=True):
        assert score.logps is not None
        assert np.abs(score.logps - _naive_logps(model, s)).max() <= 1e-4


def test_sliding_window_model_in_unmasked_buckets() -> None:
    """A window shorter than the sequences: transformers still builds the window mask itself."""
    model = tiny_causal("mistral", sliding_window=6)
    ex = StatelessExecutor(UNMASKED, model)
    seqs = _seqs(seed=5)
    out = ex.score(seqs)
    assert out.metrics.padded_tokens > 0
    for s, score in zip(seqs, out.scores, strict=True):
        assert np.abs(score.logps - _naive_logps(model, s)).max() <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_unmasked_reward_pools_the_true_last_token(arch: str) -> None:
    """pad == eos == 0 and no mask: pooling still reads each sequence's own last token."""
    model = tiny_reward(arch)
    config = ExecutorConfig(mode="reward", packing="unmasked", bucket_pad_fraction=1.0)
    ex = StatelessExecutor(config, reward_model=model)
    seqs = _seqs(seed=7, eos_last=True)
    out = ex.score(seqs)
    assert out.metrics.padded_tokens > 0
    for s, score in zip(seqs, out.scores, strict=True):
        with torch.no_grad():  # the head on the last hidden state (HF would search for pad)
            hidden = model.base_model(input_ids=torch.tensor(s.tokens)[None]).last_hidden_state
            want = float(model.score(hidden[0, -1]))
        assert score.reward == pytest.approx(want, abs=1e-4)


def test_unmasked_both_surfaces_with_token_scores() -> None:
    ref = tiny_causal("llama")
    torch.manual_seed(3)
    head = torch.nn.Linear(32, 1)
    adapter = ValueHeadAdapter(head, token_level=True)
    config = ExecutorConfig(mode="both", packing="unmasked", bucket_pad_fraction=1.0)
    ex = StatelessExecutor(config, ref, reward_adapter=adapter)
    seqs = _seqs(seed=8)
    out = ex.score(seqs)
    assert out.metrics.forwards == 1 and out.metrics.padded_tokens > 0
    for s, score in zip(seqs, out.scores, strict=True):
        with torch.no_grad():
            hidden = ref.model(input_ids=torch.tensor(s.tokens)[None]).last_hidden_state[0]
            want = head(hidden)[:, 0].numpy()
        assert score.token_scores is not None and score.token_scores.shape == (len(s.tokens),)
        assert np.abs(score.token_scores - want).max() <= 1e-5
        assert score.reward == pytest.approx(float(want[-1]), abs=1e-5)
        assert np.abs(score.logps - _naive_logps(ref, s)).max() <= 1e-4


def test_auto_layout_per_backend_and_device_pad_fraction() -> None:
    """auto: unmasked buckets on sdpa/eager, packed rows where the kernel skips cross-sequence
    blocks; on CPU a bucket holds no padding, so distinct lengths run one by one."""
    ex = StatelessExecutor(ExecutorConfig(), tiny_causal("llama"))
    assert ex.layout == "unmasked" and ex.info["packing"] == "unmasked" and not ex.packed
    assert ex._runner.layout("eager") == "unmasked"
    assert (
        ex._runner.layout("flash_attention_2") == "packed"
        and ex._runner.layout("flex_attention") == "packed"
    )
    seqs = [*_seqs(seed=1), SequenceInput(random_tokens(30, 99), prompt_len=3)]
    out = ex.score(seqs)
    assert out.metrics.padded_tokens == 0
    assert out.metrics.forwards == len(seqs) - 1  # the two 30-token sequences share a forward


def test_bidirectional_model_falls_back_to_masked_buckets() -> None:
    """A BERT reward model attends to the pads after a sequence: the load probe refuses
    unmasked buckets (and packed rows where transformers does not split them), and the layout
    it keeps gives the one-by-one rewards."""
    from transformers import BertConfig

    config = BertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, num_labels=1, initializer_range=1.0,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = random_model("BertForSequenceClassification", config, 0)
    ex = StatelessExecutor(ExecutorConfig(mode="reward", bucket_pad_fraction=1.0), None, model)
    events = [(e.requested, e.used, e.reason) for e in ex.load_fallbacks]
    assert events[0] == ("unmasked", "packed", "no_unmasked")
    # transformers >= 5.25 reads packed rows' restarting position ids as a block-diagonal mask
    # for bidirectional models too: the probe then finds packed rows exact and keeps them
    if ex.layout == "padded":
        assert events[1:] == [("packed", "padded", "no_packing")]
    else:
        assert ex.layout == "packed" and events[1:] == []
    seqs = _seqs(seed=2)
    out = ex.score(seqs)
    assert out.metrics.padded_tokens > 0 or ex.layout == "packed"
    for s, score in zip(seqs, out.scores, strict=True):
        assert score.reward == pytest.approx(ex.score([s]).scores[0].reward, abs=1e-4)
    with pytest.raises(Exception, match="packing='unmasked' requested"):
        StatelessExecutor(ExecutorConfig(mode="reward", packing="unmasked"), None, model)
