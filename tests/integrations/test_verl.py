"""``worker.integrations.verl`` / ``verl_manager`` against their documented signatures, with or
without verl installed (verl's own reward loop: ``tests/integrations/test_verl_loop.py``),
through a real no-op worker: ``compute_score(data_source, solution_str, ground_truth,
extra_info, **kw)`` per sample, coalesced; the token-exact manager's ``run_single`` on a
verl-shaped data item (left-padded ``prompts``, right-padded ``responses``, ``attention_mask``
over both), as
``verl/experimental/reward_loop/reward_manager/dapo.py`` reads one."""

from __future__ import annotations

import asyncio
import inspect
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.daemon import WorkerProc
from worker.integrations import verl, verl_manager
from worker.integrations.shared import close_all, coalescer

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def noop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    import uuid

    from tests.conftest import MACHINE_REDIS_URL

    queue = f"verl{uuid.uuid4().hex[:8]}"
    worker = WorkerProc(
        [
            "--redis-url",
            MACHINE_REDIS_URL,
            "--queue",
            queue,
            "--scorer",
            "noop",
            "--consumer",
            "w1",
            "--metrics-port",
            "0",
        ],
        tmp_path_factory.mktemp("verl") / "worker.log",
    )
    try:
        worker.wait_ready(60)
        yield MACHINE_REDIS_URL, queue
    finally:
        worker.stop()


def _noop_text(text: str) -> float:
    return (sum(text.encode()) % 1000) / 1000


def test_compute_score_has_verls_signature_and_coalesces_per_sample_calls(
    noop: tuple[str, str],
) -> None:
    url, queue = noop
    params = list(inspect.signature(verl.compute_score).parameters)
    assert params[:4] == ["data_source", "solution_str", "ground_truth", "extra_info"]
    assert inspect.iscoroutinefunction(verl.compute_score)
    n = 64

    async def run() -> tuple[list[float], int]:
        try:
            scores = await asyncio.gather(
                *(
                    verl.compute_score(
                        "gsm8k",
                        f"answer {i}",
                        str(i),
                        {"prompt": f"Q{i}: "} if i % 2 else None,
                        redis_url=url,
                        queue=queue,
                    )
                    for i in range(n)
                )
            )
            return list(scores), coalescer(url, queue).jobs
        finally:
            await close_all()

    scores, jobs = asyncio.run(run())
    want = [_noop_text((f"Q{i}: " if i % 2 else "") + f"answer {i}") for i in range(n)]
    assert scores == pytest.approx(want)
    assert jobs < n / 4  # one process, one client: per-sample calls share jobs


def test_compute_score_reads_settings_from_the_environment(
    noop: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, queue = noop
    monkeypatch.setenv("SCORING_REDIS_URL", url)
    monkeypatch.setenv("SCORING_QUEUE", queue)

    async def run() -> float:
        try:
            return await verl.compute_score(
                "d", "hello", None, {"prompt": [{"role": "user", "content": "hi"}]}
            )
        finally:
            await close_all()

    # messages: the no-op scorer scores the contents' bytes ("hi" + "hello")
    assert asyncio.run(run()) == pytest.approx(_noop_text("hihello"))


class _Item:
    """One verl data item: ``batch`` of tensors (numpy here: the manager duck-types
    ``tolist``) and ``non_tensor_batch``."""

    def __init__(self, prompt: list[int], response: list[int], width: int = 8) -> None:
        pad = [0] * (width - len(prompt))
        tail = [0] * (width - len(response))
        self.batch = {
            "prompts": np.array(pad + prompt),
            "responses": np.array(response + tail),
            "attention_mask": np.array(
                [0] * len(pad) + [1] * (len(prompt) + len(response)) + [0] * len(tail)
            ),
        }
        self.non_tensor_batch = {"data_source": "x", "reward_model": {"ground_truth": None}}


class _Data(list[Any]):
    """A one-item ``DataProto`` stand-in (``len``, ``data[0]``)."""


def test_reward_manager_sends_the_policys_ids_unpadded(noop: tuple[str, str]) -> None:
    url, queue = noop
    params = list(inspect.signature(verl_manager.ScoringRewardManager).parameters)
    assert params[:3] == ["config", "tokenizer", "compute_score"]
    assert inspect.iscoroutinefunction(verl_manager.ScoringRewardManager.run_single)
    manager = verl_manager.ScoringRewardManager({}, None, None, redis_url=url, queue=queue)
    items = [([5, 6, 7], [8, 9]), ([11], [12, 13, 14, 15]), ([3, 4, 5, 6, 7, 8], [9])]

    async def run() -> list[dict[str, Any]]:
        try:
            return list(
                await asyncio.gather(*(manager.run_single(_Data([_Item(p, r)])) for p, r in items))
            )
        finally:
            await close_all()

    out = asyncio.run(run())
    for (p, r), got in zip(items, out, strict=True):
        want = (sum(p + r) % 1000) / 1000  # the no-op reward of exactly these ids
        assert got["reward_score"] == pytest.approx(want)
        assert got["reward_extra_info"] == {"rm_score": got["reward_score"]}
    assert verl_manager.sequence_of(_Item([5, 6, 7], [8, 9]))["tokens"] == [5, 6, 7, 8, 9]


def test_modules_import_without_verl_or_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['verl'] = None\n"
        "import worker.integrations.verl, worker.integrations.verl_manager, "
        "worker.integrations.trl\n"
        "assert worker.integrations.verl_manager.ScoringRewardManager.__mro__[1].__module__"
        " == 'worker.integrations.verl_manager'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_reward_manager_sends_each_prompt_once_per_group(noop: tuple[str, str]) -> None:
    """GRPO's n rollouts per prompt: the samples of one prompt go as one job that carries the
    prompt once (``prefix``), each response after it, ``prompt_len`` 1 as ever; a prompt of
    one sample, or too short to pay for a job of its own (``MIN_SAVED_IDS``), goes plain. The
    rewards, in order, are those of the per-sequence path."""
    from tests.support.client import JobTap
    from worker import keys
    from worker.client.coalesce import MIN_SAVED_IDS
    from worker.protocol.seqs import le_bytes

    url, queue = noop
    manager = verl_manager.ScoringRewardManager({}, None, None, redis_url=url, queue=queue)
    p1, p2, p3 = list(range(100, 130)), [21, 22, 23], [31, 32]
    assert len(p1) * 2 >= MIN_SAVED_IDS > len(p2)
    items = [(p1, [8, 9]), (p2, [24]), (p1, [10]), (p3, [33, 34]), (p2, [25, 26]), (p1, [11, 12])]

    def item(p: list[int], r: list[int]) -> _Item:
        return _Item(p, r, width=32)

    async def grouped() -> list[dict[str, Any]]:
        try:
            return list(
                await asyncio.gather(*(manager.run_single(_Data([item(p, r)])) for p, r in items))
            )
        finally:
            await close_all()

    async def per_sequence() -> list[float]:  # the manager's path before groups
        try:
            batcher = coalescer(url, queue)
            scores = await asyncio.gather(
                *(
                    batcher.score([verl_manager.sequence_of(item(p, r))], manager.key, 60)
                    for p, r in items
                )
            )
            return [float(s[0].reward) for s in scores]
        finally:
            await close_all()

    with JobTap(url, keys.job_streams(queue)) as tap:
        out = asyncio.run(grouped())
        bodies = tap.bodies()
    by_prefix = {b.get("prefix"): b for b in bodies}
    assert len(bodies) == len(by_prefix) == 2

    def ids(xs: list[int]) -> bytes:
        return le_bytes(array("i", xs))

    group = by_prefix[ids(p1)]
    assert [s["tokens"] for s in group["seqs"]] == [ids([8, 9]), ids([10]), ids([11, 12])]
    assert {s["prompt_len"] for s in group["seqs"]} == {1}
    plain = by_prefix[None]["seqs"]
    assert [s["tokens"] for s in plain] == [ids([*p2, 24]), ids([*p3, 33, 34]), ids([*p2, 25, 26])]
    got = [o["reward_score"] for o in out]
    assert got == [(sum(p + r) % 1000) / 1000 for p, r in items]
    assert got == asyncio.run(per_sequence())
