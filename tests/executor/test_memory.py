"""Per-call peak memory: the peak is reset at the start of every ``score`` call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.models import random_tokens, tiny_causal
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor, memory
from worker.executor import core as executor_module

SEQS = [SequenceInput(random_tokens(n, n), prompt_len=2) for n in (9, 14)]


def test_peak_is_reset_before_and_read_after_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    ex = StatelessExecutor(ExecutorConfig(), tiny_causal("llama"))
    events: list[str] = []
    real_reset, real_read = executor_module.reset_peak, executor_module.read_peak

    def reset(device: torch.device) -> None:
        events.append("reset")
        real_reset(device)

    def read(device: torch.device) -> tuple[int, int]:
        events.append("read")
        return real_read(device)

    monkeypatch.setattr(executor_module, "reset_peak", reset)
    monkeypatch.setattr(executor_module, "read_peak", read)
    for _ in range(3):
        ex.score(SEQS)
    assert events == ["reset", "read"] * 3


def _clear_refs_works() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def test_cpu_peak_after_a_big_allocation_is_the_calls_own() -> None:
    """A small call after a large transient allocation reports its own (smaller) peak, not the
    process's lifetime high-water mark."""
    if not _clear_refs_works():
        pytest.skip("cannot reset the RSS high-water mark here (/proc/self/clear_refs)")
    ex = StatelessExecutor(ExecutorConfig(), tiny_causal("llama"))
    first = ex.score(SEQS).metrics.peak_allocated_bytes
    big = np.ones(384 * 2**20 // 8)  # 384 MiB, touched: an mmap that free() returns to the OS
    big_rss = memory.peak_rss_bytes()
    del big  # the lifetime high-water mark keeps it; the next call must not report it
    second = ex.score(SEQS).metrics
    assert second.peak_allocated_bytes == second.peak_reserved_bytes
    assert second.peak_allocated_bytes < big_rss - 256 * 2**20
    assert second.peak_allocated_bytes < first + 128 * 2**20


def test_reset_peak_lowers_the_high_water_mark() -> None:
    if not _clear_refs_works():
        pytest.skip("cannot reset the RSS high-water mark here (/proc/self/clear_refs)")
    cpu = torch.device("cpu")
    big = np.ones(256 * 2**20 // 8)
    del big
    before = memory.read_peak(cpu)[0]
    memory.reset_peak(cpu)
    assert memory.read_peak(cpu)[0] < before - 128 * 2**20
