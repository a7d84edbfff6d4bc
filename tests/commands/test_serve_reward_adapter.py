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


def test_an_adapter_without_a_reward_model_reads_the_reference_vlm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--reference-model <Qwen2.5-VL> --reward-adapter m:f`` and no ``--reward-model``: one
    model loaded serves both modes through the value head (transformers has no
    ``Qwen2_5_VLForSequenceClassification`` to load as a reward model); a ``both`` job with an
    image is one call, its rewards those of the same head on the executor built in Python."""

    from tests.support.vision import image_file, image_tokens, placeholder
    from worker.demo.tiny import save_tiny_vlm
    from worker.executor import ExecutorConfig, StatelessExecutor
    from worker.request import Images, ScoreRequest

    path = save_tiny_vlm(tmp_path / "vlm", "qwen2_5_vl", seed=3)
    (tmp_path / "vlm_heads.py").write_text(
        "import torch\n"
        "from worker.executor.rewards.pooling import ValueHeadAdapter\n"
        "def make(token_level=False):\n"
        "    torch.manual_seed(3)\n"
        "    return ValueHeadAdapter(torch.nn.Linear(32, 1), token_level=token_level)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        scorer = _scorer(
            "--reference-model", str(path), "--reward-adapter", "vlm_heads:make",
            "--device", "cpu", "--dtype", "float32",
        )  # fmt: skip
        import vlm_heads  # type: ignore[import-not-found]

        head = vlm_heads.make()
    finally:
        sys.modules.pop("vlm_heads", None)
    assert scorer.reward_model is scorer.reference_model and "both" in scorer.modes
    image = image_file(60, 40, seed=1)
    assert scorer._vision is not None
    n = image_tokens(scorer._vision.processing.processor, image)
    inputs = [
        SequenceInput(tokens=[1, 2, *placeholder(n), 3, 4, 5 + k], prompt_len=3, images=(0,))
        for k in range(2)
    ]
    request = ScoreRequest(inputs, mode="both", images=Images((image,)))
    prepared = scorer.prepare(request)
    assert [c.mode for c in prepared.plan] == ["both"]  # one backbone forward for both
    got = scorer.run([prepared]).scores
    model = scorer.reference_model
    config = ExecutorConfig(dtype="float32", mode="both")
    processor = scorer._vision.processing.processor
    from worker.executor.rewards.pooling import ValueHeadAdapter

    assert isinstance(head, ValueHeadAdapter)
    ex = StatelessExecutor(config, model, reward_adapter=head, image_processor=processor)
    want = ex.run([ex.prepare(request)]).scores
    for a, b in zip(got, want, strict=True):
        assert a.reward is not None and b.reward is not None and abs(a.reward - b.reward) < 1e-6
        assert a.logps is not None and b.logps is not None
        assert np.abs(a.logps - b.logps).max() < 1e-6
    ex.close()
    scorer.close()
    args = build_parser("serve").parse_args(
        ["serve", "--reference-model", str(path), "--reward-adapter", "vlm_heads:make",
         "--tensor-parallel", "2"]
    )  # fmt: skip
    from worker.commands.serve import check_models

    with pytest.raises(ConfigError, match="tensor-parallel"):
        check_models(args)
