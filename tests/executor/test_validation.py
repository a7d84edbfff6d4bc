"""Every invalid config and every invalid input gets its typed error with a clear message."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.models import VOCAB, random_tokens, tiny_causal, tiny_reward
from worker.errors import BadRequest, ConfigError, TooLong, UnsupportedMode
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor


@pytest.fixture(scope="module")
def ex() -> StatelessExecutor:
    return StatelessExecutor(ExecutorConfig(), tiny_causal("llama"))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("mode", "policy"),
        ("attention_backend", "flash_attention_9"),
        ("reject_kv_cache_outputs", "yes"),
        ("temperature", 0.0),
        ("temperature", -1.0),
        ("temperature", float("nan")),
        ("temperature", True),
        ("output_dtype", "float16"),
        ("max_batch_tokens", 0),
        ("max_batch_tokens", 1.5),
        ("logprob_chunk_tokens", -3),
        ("device", "tpu"),
        ("device", "cuda:x"),
        ("dtype", "int8"),
        ("packing", "sometimes"),
    ],
)
def test_invalid_config_raises_at_construction(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        ExecutorConfig(**{field: value})


def test_executor_construction_errors() -> None:
    with pytest.raises(ConfigError, match="reference_model or a reward_model"):
        StatelessExecutor(ExecutorConfig())
    with pytest.raises(ConfigError, match="mode"):
        StatelessExecutor(ExecutorConfig(mode="both"), tiny_causal("llama"))


GOOD = random_tokens(6, 0)


@pytest.mark.parametrize(
    ("seqs", "error", "match"),
    [
        ([], BadRequest, "no sequences"),
        ("abc", BadRequest, "list"),
        ([object()], BadRequest, "SequenceInput"),
        ([SequenceInput([1], prompt_len=1)], BadRequest, "at least 2"),
        ([SequenceInput([], prompt_len=1)], BadRequest, "at least 2"),
        ([SequenceInput([[1, 2], [3, 4]], prompt_len=1)], BadRequest, "1-D"),
        ([SequenceInput([1.5, 2.0], prompt_len=1)], BadRequest, "integers"),
        ([SequenceInput("hello", prompt_len=1)], BadRequest, "sequence of ints"),
        ([SequenceInput([1, VOCAB], prompt_len=1)], BadRequest, f"token id {VOCAB} outside"),
        ([SequenceInput([1, -1], prompt_len=1)], BadRequest, "token id -1 outside"),
        ([SequenceInput([1] * 257, prompt_len=1)], TooLong, "257 tokens exceed"),
        ([SequenceInput(GOOD)], BadRequest, "prompt_len or mask"),
        ([SequenceInput(GOOD, prompt_len=2, mask=[0, 1, 1, 1, 1, 1])], BadRequest, "not both"),
        ([SequenceInput(GOOD, prompt_len=0)], BadRequest, r"prompt_len 0 outside \[1, 6\)"),
        ([SequenceInput(GOOD, prompt_len=6)], BadRequest, "outside"),
        ([SequenceInput(GOOD, prompt_len=2.0)], BadRequest, "must be an int"),
        ([SequenceInput(GOOD, prompt_len=True)], BadRequest, "must be an int"),
        ([SequenceInput(GOOD, mask=[0, 1, 1])], BadRequest, "3 entries for 6 tokens"),
        ([SequenceInput(GOOD, mask=[0, 0, 0, 0, 0, 0])], BadRequest, "scores no token"),
        ([SequenceInput(GOOD, mask=[1, 1, 1, 1, 1, 1])], BadRequest, r"mask\[0\] must be 0"),
        ([SequenceInput(GOOD, mask=[0, 2, 1, 1, 1, 1])], BadRequest, "0 or 1"),
        ([SequenceInput(GOOD, mask=b"\x00\x01")], BadRequest, "2 entries"),
        (
            [SequenceInput(GOOD, prompt_len=1), SequenceInput(GOOD, prompt_len=9)],
            BadRequest,
            "sequence 1: prompt_len 9",
        ),
    ],
)
def test_invalid_inputs(ex: StatelessExecutor, seqs: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ex.validate(seqs)
    with pytest.raises(error, match=match):
        ex.score(seqs)


def test_mode_and_temperature_errors(ex: StatelessExecutor) -> None:
    seqs = [SequenceInput(GOOD, prompt_len=1)]
    with pytest.raises(UnsupportedMode, match="reward") as info:
        ex.score(seqs, mode="reward")
    assert info.value.code == "unsupported_mode"
    with pytest.raises(UnsupportedMode):
        ex.validate(seqs, mode="both")
    with pytest.raises(BadRequest, match="unknown mode"):
        ex.validate(seqs, mode="sample")  # type: ignore[arg-type]
    for bad in (0, -0.5, float("inf"), "1"):
        with pytest.raises(BadRequest, match="temperature"):
            ex.score(seqs, temperature=bad)  # type: ignore[arg-type]


def test_reward_only_executor_rejects_reference() -> None:
    rex = StatelessExecutor(ExecutorConfig(mode="reward"), reward_model=tiny_reward("gpt2"))
    assert rex.modes == ("reward",)
    with pytest.raises(UnsupportedMode):
        rex.score([SequenceInput(GOOD, prompt_len=1)], mode="reference")


def test_properties(ex: StatelessExecutor) -> None:
    assert ex.vocab_size == VOCAB and ex.max_positions == 256 and ex.modes == ("reference",)
    info = ex.info
    for key in ("model", "dtype", "device", "attention_backend", "requested_backend", "torch",
                "transformers", "fallback"):  # fmt: skip
        assert key in info
    assert info["dtype"] == "float32" and info["device"] == "cpu"
