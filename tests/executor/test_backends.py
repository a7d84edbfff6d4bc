"""Attention-backend fallback at load and at run time, and the packed -> padded fallback."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from transformers.modeling_utils import AttentionInterface

from tests.support.models import random_tokens, tiny_causal
from worker.errors import AttentionBackendError, InternalError
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.executor.backends import FallbackEvent, is_attention_kernel_error

SEQS = [SequenceInput(random_tokens(n, n), prompt_len=2) for n in (11, 6, 17)]


def _broken_sdpa(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("simulated sdpa kernel failure")


def test_flash_attention_2_on_cpu_falls_back_with_reason() -> None:
    ex = StatelessExecutor(ExecutorConfig(attention_backend="flash_attention_2"), tiny_causal())
    assert ex.attention_backend == "sdpa"
    (event,) = ex.load_fallbacks
    assert event.requested == "flash_attention_2" and event.used == "sdpa" and event.at == "load"
    assert event.reason in ("not_installed", "unsupported_device")
    info = ex.info
    assert info["attention_backend"] == "sdpa"
    assert info["requested_backend"] == "flash_attention_2"
    assert info["fallback"]["reason"] == event.reason
    out = ex.score(SEQS)
    assert out.metrics.backend == "sdpa" and out.metrics.requested_backend == "flash_attention_2"


def test_auto_picks_sdpa_on_cpu_without_a_fallback_event() -> None:
    ex = StatelessExecutor(ExecutorConfig(), tiny_causal())
    assert (
        ex.attention_backend == "sdpa" and ex.load_fallbacks == [] and ex.info["fallback"] is None
    )


def test_kernel_error_retries_on_next_backend_and_keeps_config(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model = tiny_causal("llama")
    ex = StatelessExecutor(ExecutorConfig(attention_backend="sdpa", packing="packed"), model)
    want = ex.score(SEQS).scores  # packed: one forward, so one run-time fallback event
    seen: list[FallbackEvent] = []
    ex.add_fallback_listener(seen.append)
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", _broken_sdpa)
    out = ex.score(SEQS)
    assert out.metrics.backend == "eager"
    (event,) = out.metrics.fallbacks
    assert (event.requested, event.used, event.reason, event.at) == (
        "sdpa",
        "eager",
        "kernel_error",
        "run",
    )
    assert "simulated sdpa kernel failure" in event.message
    assert seen == [event]
    assert model.config._attn_implementation == "sdpa"  # the switch was temporary
    assert ex.attention_backend == "sdpa" and ex.config.attention_backend == "sdpa"
    assert ex.info["fallback"]["reason"] == "kernel_error"
    for a, b in zip(out.scores, want, strict=True):
        assert np.abs(a.logps - b.logps).max() <= 1e-5


def test_failed_switch_leaves_config_exactly_as_it_was(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model = tiny_causal("llama")
    ex = StatelessExecutor(ExecutorConfig(attention_backend="sdpa"), model)
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", _broken_sdpa)

    def half_switch(impl: str, **_: Any) -> None:
        model.config._attn_implementation_internal = "garbage"
        raise ValueError("cannot switch")

    monkeypatch.setattr(model, "set_attn_implementation", half_switch)
    with pytest.raises(AttentionBackendError, match="cannot switch"):
        ex.score(SEQS)
    assert model.config._attn_implementation == "sdpa"


def test_non_attention_error_is_not_retried(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model = tiny_causal("llama")
    ex = StatelessExecutor(ExecutorConfig(), model)

    def broken_mlp(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("mlp exploded")

    monkeypatch.setattr(model.model.layers[0].mlp, "forward", broken_mlp)
    with pytest.raises(InternalError, match="mlp exploded") as info:
        ex.score(SEQS)
    assert not is_attention_kernel_error(info.value.__cause__)  # type: ignore[arg-type]


def test_eager_kernel_error_has_nowhere_to_go(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import transformers.models.llama.modeling_llama as ml

    model = tiny_causal("llama")
    ex = StatelessExecutor(ExecutorConfig(attention_backend="eager"), model)

    def eager_attention_forward(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("eager kernel failure")

    monkeypatch.setattr(ml, "eager_attention_forward", eager_attention_forward)
    with pytest.raises(AttentionBackendError, match="eager kernel failure"):
        ex.score(SEQS)


def test_unisolated_packing_falls_back_to_padded(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """If packed rows leak across sequences (simulated: mask detection off), the load probe sees
    it and the executor runs padded buckets instead, with a no_packing fallback event (on sdpa
    the auto layout's unmasked buckets; a pad fraction of 1 makes them hold padding)."""
    import transformers.masking_utils as mu

    model = tiny_causal("llama")
    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda position_ids: None)
    ex = StatelessExecutor(ExecutorConfig(bucket_pad_fraction=1.0), model)
    assert not ex.packed
    (event,) = ex.load_fallbacks
    assert event.reason == "no_packing" and (event.requested, event.used) == ("packed", "unmasked")
    out = ex.score(SEQS)
    assert not out.metrics.packed and out.metrics.padded_tokens > 0
    assert out.metrics.packed_fill_tokens == 0
    for s, score in zip(SEQS, out.scores, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(s.tokens)[None]).logits[0].double()
        want = torch.log_softmax(logits, -1)[
            torch.arange(1, len(s.tokens) - 1), torch.tensor(s.tokens[2:])
        ].numpy()
        assert np.abs(score.logps - want).max() <= 1e-4
