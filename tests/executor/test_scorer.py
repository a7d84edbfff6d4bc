"""The executor and the no-op scorer implement the ``Scorer`` protocol the daemon drives."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.models import random_tokens, tiny_causal, tiny_reward
from worker.errors import UnsupportedMode
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.modes import MODES
from worker.scorer import INFO_KEYS, OPTIONAL_INFO_KEYS, RESULT_INFO_KEYS, FallbackEvent, Scorer
from worker.scorer.noop import NoopScorer

SEQS = [SequenceInput(random_tokens(n, n), prompt_len=2) for n in (7, 11)]


@pytest.fixture(scope="module")
def scorers() -> list[Scorer]:
    executor = StatelessExecutor(ExecutorConfig(mode="both"), tiny_causal(), tiny_reward())
    return [executor, NoopScorer()]


def test_both_are_scorers_and_describe_themselves_alike(scorers: list[Scorer]) -> None:
    assert set(RESULT_INFO_KEYS) <= {*INFO_KEYS, *OPTIONAL_INFO_KEYS}  # declared keys
    for scorer in scorers:
        assert isinstance(scorer, Scorer), type(scorer).__name__
        info = scorer.info
        missing = set(INFO_KEYS) - set(info)
        assert not missing, f"{type(scorer).__name__}.info lacks {sorted(missing)}"
        assert set(scorer.modes) <= set(MODES) and scorer.modes
        assert scorer.load_fallbacks == []
        assert all(isinstance(e, FallbackEvent) for e in scorer.load_fallbacks)


def test_both_accept_the_protocols_calls(scorers: list[Scorer]) -> None:
    """Positional or keyword mode/temperature for ``validate``, keywords for ``score``, and
    the defaults (``None``) on both."""
    heard: list[FallbackEvent] = []
    for scorer in scorers:
        scorer.add_fallback_listener(heard.append)
        scorer.validate(SEQS)
        scorer.validate(SEQS, "both", 0.7)
        default = scorer.score(SEQS)
        explicit = scorer.score(SEQS, mode="reference", temperature=1.0)
        for a, b in zip(default.scores, explicit.scores, strict=True):
            assert a.logps is not None and np.array_equal(a.logps, b.logps)
        both = scorer.score(SEQS, mode="both", temperature=0.5)
        assert all(s.logps is not None and s.reward is not None for s in both.scores)
        assert both.metrics.batch_size == len(SEQS)
    assert heard == []


def test_unserved_mode_is_refused_by_the_executor() -> None:
    scorer: Scorer = StatelessExecutor(ExecutorConfig(), tiny_causal())
    assert scorer.modes == ("reference",)
    with pytest.raises(UnsupportedMode):
        scorer.validate(SEQS, "reward")
