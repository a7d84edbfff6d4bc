"""A model that returns a KV cache despite use_cache=False is rejected (or warned and dropped)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
from transformers.cache_utils import DynamicCache

from tests.support.models import random_tokens, tiny_causal
from worker.errors import KVCacheRejected
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor

SEQS = [SequenceInput(random_tokens(n, n), prompt_len=1) for n in (8, 5)]


def _leak_cache(model: Any) -> None:
    """Make the backbone return a filled DynamicCache whatever use_cache says."""
    backbone = model.model
    original = backbone.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        cache = DynamicCache(config=model.config)
        hidden = out.last_hidden_state  # [R, T, H]
        kv = hidden.new_zeros(hidden.shape[0], 2, hidden.shape[1], 8)  # [R, kv_heads, T, d]
        for layer in range(model.config.num_hidden_layers):
            cache.update(kv.clone(), kv.clone(), layer)
        out["past_key_values"] = cache
        return out

    backbone.forward = forward


def test_cache_output_is_rejected_and_counted() -> None:
    model = tiny_causal("llama")
    ex = StatelessExecutor(ExecutorConfig(packing="packed"), model)  # one forward: 13 tokens
    _leak_cache(model)
    with pytest.raises(KVCacheRejected, match="KV cache") as info:
        ex.score(SEQS)
    err = info.value
    assert err.code == "internal"
    assert err.kv_output_tensors == 4  # type: ignore[attr-defined]  # 2 layers x (k, v)
    assert err.kv_output_bytes == 4 * 1 * 2 * 13 * 8 * 4


def test_cache_output_warn_and_drop(caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_causal("llama")
    ex = StatelessExecutor(ExecutorConfig(reject_kv_cache_outputs=False, packing="packed"), model)
    clean = ex.score(SEQS)
    assert clean.metrics.kv_output_tensors == 0
    _leak_cache(model)
    with caplog.at_level("WARNING", logger="worker.executor"):
        out = ex.score(SEQS)
    assert out.metrics.kv_output_tensors == 4 and out.metrics.kv_output_bytes > 0
    assert not out.metrics.kv_rejected
    assert any("KV cache" in r.getMessage() for r in caplog.records)
    for a, b in zip(out.scores, clean.scores, strict=True):
        assert np.array_equal(a.logps, b.logps)


def test_leaking_model_constructs_fine() -> None:
    """The load-time probe ignores caches; rejection happens on the first real batch."""
    model = tiny_causal("llama")
    _leak_cache(model)
    ex = StatelessExecutor(ExecutorConfig(), model)
    with pytest.raises(KVCacheRejected):
        ex.score(SEQS)


def test_close_detaches_hooks() -> None:
    model = tiny_causal("llama")
    before = (len(model._forward_hooks), len(model.model._forward_hooks))
    ex = StatelessExecutor(ExecutorConfig(), model)
    assert len(model._forward_hooks) == before[0] + 1
    ex.close()
    assert (len(model._forward_hooks), len(model.model._forward_hooks)) == before


def test_each_thread_counts_its_own_forwards_caches() -> None:
    """The guard's scope is per forward and per thread: two calls at once each report the
    caches of their own forward (4 tensors), not each other's, and a forward outside any
    scope (the model used directly) is neither counted nor altered."""
    model = tiny_causal("llama")
    ex = StatelessExecutor(ExecutorConfig(reject_kv_cache_outputs=False), model)
    _leak_cache(model)
    barrier = threading.Barrier(2)
    outs: list[Any] = []

    def call() -> None:
        barrier.wait()
        outs.extend(ex.score(SEQS) for _ in range(3))

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(outs) == 6
    assert all(o.metrics.kv_output_tensors == 4 * o.metrics.forwards for o in outs)
    direct = model(input_ids=torch.tensor([SEQS[0].tokens]), use_cache=False)
    assert direct.past_key_values is not None  # untouched outside a scope
