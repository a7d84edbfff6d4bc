"""`serve --reward-token-scores` and `--reward-adapter module:factory` build the reward path."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.models import random_tokens, tiny_reward
from worker.cli import build_parser
from worker.commands.serve import build_scorer
from worker.errors import ConfigError
from worker.executor import SequenceInput
from worker.executor.rewards.pooling import SequenceClassificationAdapter, ValueHeadAdapter


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("rm")
    tiny_reward("llama").save_pretrained(path)
    return str(path)


def _scorer(*flags: str):  # type: ignore[no-untyped-def]
    args = build_parser("serve").parse_args(["serve", *flags])
    return build_scorer(args)


def test_token_scores_on_request(reward_dir: str) -> None:
    plain = _scorer("--reward-model", reward_dir)
    assert isinstance(plain.reward_adapter, SequenceClassificationAdapter)
    assert not plain.reward_adapter.token_level
    scorer = _scorer("--reward-model", reward_dir, "--reward-token-scores")
    seq = SequenceInput(random_tokens(9, 0), prompt_len=3)
    (score,) = scorer.score([seq], mode="reward").scores
    assert score.token_scores is not None and score.token_scores.shape == (9,)
    # The sequence reward is the head at the true last token.
    assert np.isclose(score.token_scores[-1], score.reward, atol=1e-5)
    assert plain.score([seq], mode="reward").scores[0].token_scores is None


def test_custom_adapter_factory(
    reward_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_heads.py").write_text(
        "import torch\n"
        "from worker.executor.rewards.pooling import ValueHeadAdapter\n"
        "def make(token_level=False):\n"
        "    torch.manual_seed(3)\n"
        "    return ValueHeadAdapter(torch.nn.Linear(32, 1), token_level=token_level)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        scorer = _scorer("--reward-model", reward_dir, "--reward-adapter", "my_heads:make")
        assert isinstance(scorer.reward_adapter, ValueHeadAdapter)
        (score,) = scorer.score([SequenceInput(random_tokens(6, 1))], mode="reward").scores
        assert score.reward is not None and np.isfinite(score.reward)
    finally:
        sys.modules.pop("my_heads", None)
    with pytest.raises(ConfigError, match="module:factory"):
        _scorer("--reward-model", reward_dir, "--reward-adapter", "no_colon")
    with pytest.raises(ConfigError, match="cannot be loaded"):
        _scorer("--reward-model", reward_dir, "--reward-adapter", "nope_module:make")
