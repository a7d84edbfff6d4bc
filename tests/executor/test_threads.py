"""One executor, several threads: concurrent ``score`` calls give the sequential results.

The executor keeps no per-call state on itself (a ``ScoreCall`` per call, a per-thread KV-guard
scope), and forwards on the active backend share ``BackendGate``; only a run-time backend
switch holds it alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.support.models import random_tokens, tiny_causal, tiny_reward
from worker.executor import ExecutorConfig, ScoreOutput, SequenceInput, StatelessExecutor
from worker.executor.fallback import BackendGate

ROUNDS = 4


def _jobs() -> list[list[SequenceInput]]:
    """Two different workloads: different lengths, so different plans and paddings."""
    return [
        [SequenceInput(random_tokens(n, 10 * k + n), prompt_len=3) for n in lengths]
        for k, lengths in enumerate(((9, 31, 4, 17), (25, 6, 12, 40, 8, 5)))
    ]


def _in_threads(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run every call in its own thread, released together; re-raise the first failure."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = calls[i]()
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a scoring thread hung"
    if errors:
        raise errors[0]
    return results


def _same(a: ScoreOutput, b: ScoreOutput) -> None:
    for x, y in zip(a.scores, b.scores, strict=True):
        assert (x.logps is None) == (y.logps is None) and (x.reward is None) == (y.reward is None)
        if x.logps is not None:
            np.testing.assert_allclose(x.logps, y.logps, rtol=0, atol=1e-6)
        if x.reward is not None:
            assert x.reward == pytest.approx(y.reward, abs=1e-6)
    for name in ("batch_size", "real_tokens", "padded_tokens", "packed_fill_tokens", "forwards"):
        assert getattr(a.metrics, name) == getattr(b.metrics, name), name


@pytest.mark.parametrize("packing", ["packed", "padded"])
def test_concurrent_calls_equal_sequential_calls(packing: str) -> None:
    ex = StatelessExecutor(
        ExecutorConfig(mode="both", packing=packing, max_batch_tokens=48, packed_row_tokens=48),
        tiny_causal(),
        tiny_reward(),
    )
    jobs = _jobs()
    want = [ex.score(seqs) for seqs in jobs]
    calls = [
        (lambda seqs=seqs: [ex.score(seqs) for _ in range(ROUNDS)]) for seqs in jobs for _ in "ab"
    ]
    got = _in_threads(calls)
    for k, outs in enumerate(got):
        for out in outs:
            _same(out, want[k // 2])


def test_gate_switch_waits_for_forwards_and_holds_them_back() -> None:
    gate = BackendGate()
    log: list[str] = []
    in_forward, switch_waiting = threading.Event(), threading.Event()

    def forward() -> None:
        with gate.shared():
            log.append("forward in")
            in_forward.set()
            switch_waiting.wait(5)
            time.sleep(0.05)
            log.append("forward out")

    def switch() -> None:
        in_forward.wait(5)
        switch_waiting.set()
        with gate.exclusive():
            log.append("switch")

    def late_forward() -> None:
        switch_waiting.wait(5)
        time.sleep(0.02)  # arrives while the switch waits: must not overtake it
        with gate.shared():
            log.append("late forward")

    _in_threads([forward, switch, late_forward])
    assert log == ["forward in", "forward out", "switch", "late forward"]
