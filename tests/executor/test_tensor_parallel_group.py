"""A tensor-parallel group's own behaviour: two gloo ranks against one process (teacher outputs,
rewards, tree rows of shared prefixes, an OOM on one rank or on both halving the batch on both,
a kernel failure falling back on both, the per-rank memory of a wide vocabulary with no
``[rows, V]`` block), the watchdog that takes a group down, and ``--gpus all
--tensor-parallel 2`` handing each group its GPUs."""

from __future__ import annotations

import pickle
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.models import tiny_causal, tiny_reward
from tests.support.tp_ranks import _calls
from worker.errors import ConfigError

ATOL = 1e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the phases of ``tests/support/tp_ranks.py`` once on two ranks; rank 0's record."""
    from worker.processes.tp_local import launch

    root = tmp_path_factory.mktemp("tp-group")
    tiny_causal("llama", seed=0).save_pretrained(root / "ref")
    tiny_reward("llama", seed=1).save_pretrained(root / "rew")
    tiny_causal("llama", seed=2, vocab=32768).save_pretrained(root / "wide")
    paths = launch(2, "tests.support.tp_ranks", ["--models", str(root)], out=root)
    seen = [pickle.loads(p.read_bytes()) for p in paths]
    return {"root": root, "leader": seen[0], "follower": seen[1]}


def _one_process(root: Path, model: str = "ref", reward: bool = True) -> Any:
    from worker.executor import ExecutorConfig, StatelessExecutor

    return StatelessExecutor.from_pretrained(
        ExecutorConfig(mode="both" if reward else "reference", device="cpu"),
        reference_model=str(root / model),
        reward_model=str(root / "rew") if reward else None,
    )


def _same(got: Any, want: Any) -> None:
    for g, w in zip(got.scores, want.scores, strict=True):
        assert g.error is None
        if w.logps is not None:
            np.testing.assert_allclose(g.logps, w.logps, atol=ATOL, rtol=0)
        if w.reward is not None:
            assert g.reward == pytest.approx(w.reward, abs=ATOL)
        for name, value in (w.arrays or {}).items():
            assert g.arrays is not None
            if value.dtype.kind == "i":
                np.testing.assert_array_equal(g.arrays[name], value)
            else:
                np.testing.assert_allclose(g.arrays[name], value, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_two_ranks_equal_one_process(ranks: dict[str, Any]) -> None:
    one = _one_process(ranks["root"])
    for phase in ("tree", "outputs", "oom_head", "oom_backbone", "kernel"):
        for call, got in zip(_calls()[phase], ranks["leader"][phase]["outputs"], strict=True):
            want = one.score(
                call.seqs, mode=call.mode, temperature=call.temperature, options=call.options
            )
            _same(got, want)
    report = ranks["leader"]["outputs"]["outputs"][0].metrics.group
    assert report.size == 2 and report.devices == ("cpu", "cpu")
    assert len(report.rank_peak_bytes) == 2 and min(report.rank_peak_bytes) > 0
    assert {"broadcast", "vote", "head", "peaks"} <= set(report.collective_s)


@pytest.mark.slow
def test_both_ranks_share_the_groups_prefixes(ranks: dict[str, Any]) -> None:
    """The load check agrees on both ranks and both run the same tree rows (the prompt and each
    turn once): the results equal one process (``test_two_ranks_equal_one_process``)."""
    assert ranks["leader"]["prefix_sharing"] == ranks["follower"]["prefix_sharing"] == "on"
    for lead, follow in zip(
        ranks["leader"]["tree"]["outputs"], ranks["follower"]["tree"]["outputs"], strict=True
    ):
        assert lead.metrics.shared_prefix_tokens == 40 + 2 * 36  # the prompt, each turn
        assert follow.metrics.shared_prefix_tokens == lead.metrics.shared_prefix_tokens
        assert follow.metrics.forwards == lead.metrics.forwards == 1


@pytest.mark.slow
def test_only_the_leader_copies_hidden_rows_to_the_host(ranks: dict[str, Any]) -> None:
    """``hidden`` rows are the same on every rank: the leader's go into the result (equal to one
    process, ``test_two_ranks_equal_one_process``), a follower neither casts nor copies its own,
    with the LM head's outputs (``logps``, ``topk``...) or without any head."""
    for phase, calls in (("outputs", (0, 3)), ("tree", (0,))):
        for i in calls:
            lead = ranks["leader"][phase]["outputs"][i]
            follow = ranks["follower"][phase]["outputs"][i]
            for mine, theirs in zip(lead.scores, follow.scores, strict=True):
                assert mine.arrays["hidden"].shape[0] > 0
                assert "hidden" not in (theirs.arrays or {}), (phase, i)
                if i == 0:  # the LM head's outputs are still computed on both
                    np.testing.assert_allclose(theirs.logps, mine.logps, atol=ATOL, rtol=0)
                    assert "topk_ids" in theirs.arrays


@pytest.mark.slow
def test_an_oom_on_either_rank_halves_the_batch_on_both(ranks: dict[str, Any]) -> None:
    for phase in ("oom_head", "oom_backbone"):
        (lead,) = ranks["leader"][phase]["outputs"]
        (follow,) = ranks["follower"][phase]["outputs"]
        assert lead.metrics.oom_splits >= 1, phase
        assert follow.metrics.oom_splits == lead.metrics.oom_splits, phase
        assert follow.metrics.forwards == lead.metrics.forwards > 1, phase


@pytest.mark.slow
def test_a_kernel_failure_falls_back_on_both(ranks: dict[str, Any]) -> None:
    (lead,) = ranks["leader"]["kernel"]["outputs"]
    (follow,) = ranks["follower"]["kernel"]["outputs"]
    for out in (lead, follow):
        assert out.metrics.backend == "eager"
        (event,) = out.metrics.fallbacks
        assert (event.requested, event.used, event.reason) == ("sdpa", "eager", "kernel_error")


@pytest.mark.slow
def test_a_kv_cache_output_is_rejected_on_both(ranks: dict[str, Any]) -> None:
    """The KV guard rejects the batch on every rank alike: the leader answers it as an error,
    the follower drops it, and the group serves the next phase."""
    (lead,) = ranks["leader"]["kv"]["outputs"]
    assert lead[:2] == ("KVCacheRejected", "internal") and "KV cache" in lead[2]
    assert ranks["follower"]["kv"]["outputs"] == []  # the follower's call raised too
    assert ranks["leader"]["memory"]["outputs"]  # and the group went on


@pytest.mark.slow
def test_no_rank_holds_a_rows_by_vocabulary_block(ranks: dict[str, Any]) -> None:
    """48 x 255 scored rows over a vocabulary of 32,768: a ``[rows, V]`` float32 block would
    be 1.5 GiB. Each rank's peak during the call (the executor's per-call accounting, RSS on
    CPU) stays far under even an eighth of it: the head's blocks are ``[1024, V / 2]``."""
    (lead,) = ranks["leader"]["memory"]["outputs"]
    rows = lead.metrics.scored_tokens
    assert rows == 48 * 255
    block = rows * 32768 * 4
    for who in ("leader", "follower"):
        rank = ranks[who]["memory"]
        (out,) = rank["outputs"]
        extra = out.metrics.peak_allocated_bytes - rank["rss_before"]
        assert extra < block / 8, (who, extra / 2**20)
    peaks = lead.metrics.group.rank_peak_bytes
    assert peaks[1] == ranks["follower"]["memory"]["outputs"][0].metrics.peak_allocated_bytes
    one = _one_process(ranks["root"], "wide", reward=False)
    call = _calls()["memory"][0]
    want = one.score(call.seqs[:4], mode="reference")
    for g, w in zip(lead.scores[:4], want.scores, strict=True):
        np.testing.assert_allclose(g.logps, w.logps, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- the watch


class _Clock:
    def __init__(self, busy: float | None = None) -> None:
        self.busy = busy

    def busy_for(self) -> float | None:
        return self.busy


def _watch(clock: _Clock, **kwargs: Any) -> tuple[Any, socket.socket, list[tuple[str, int]]]:
    from worker.processes.tp_group import TpGroupWatch

    faults: list[tuple[str, int]] = []
    done = threading.Event()

    def on_fault(reason: str, code: int) -> Any:
        faults.append((reason, code))
        done.set()
        raise SystemExit(0)

    mine, theirs = socket.socketpair()
    watch = TpGroupWatch(0, {1: mine}, clock, kwargs.pop("timeout_s", 60.0), on_fault, **kwargs)
    watch.done = done  # type: ignore[attr-defined]
    return watch.start(), theirs, faults


def test_a_peer_that_closes_its_channel_takes_the_group_down() -> None:
    watch, theirs, faults = _watch(_Clock())
    theirs.close()
    assert watch.done.wait(5)
    assert "rank 1 closed its channel" in faults[0][0] and faults[0][1] == 75


def test_a_silent_peer_and_a_long_step_take_the_group_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker.processes import tp_group

    monkeypatch.setattr(tp_group, "HEARTBEAT_TIMEOUT_S", 0.6)
    watch, theirs, faults = _watch(_Clock())
    assert watch.done.wait(5)
    assert "sent no heartbeat" in faults[0][0]
    theirs.close()
    watch, theirs, faults = _watch(_Clock(busy=9.0), timeout_s=5.0)
    assert watch.done.wait(5)
    assert "spent 9 s in one batch" in faults[0][0]
    theirs.close()


def test_a_follower_that_exits_is_named_with_its_code() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(2)"])
    proc.wait()
    watch, theirs, faults = _watch(_Clock(), procs={1: proc})
    assert watch.done.wait(5)
    assert faults[0] == ("rank 1 exited with 2", 2)  # a config error stays exit 2
    theirs.close()


def test_a_stopped_watch_is_no_fault() -> None:
    watch, theirs, faults = _watch(_Clock())
    for _ in range(3):
        theirs.send(b".")
        time.sleep(0.1)
    watch.stop()
    theirs.close()
    time.sleep(0.3)
    assert faults == []


# ----------------------------------------------------------------------------- the fleet


def test_gpus_all_with_tensor_parallel_gives_each_group_its_gpus() -> None:
    from worker.cli import build_parser
    from worker.commands.serve import flag_defaults
    from worker.processes.fleet import build_children

    parser = build_parser("serve")
    args = parser.parse_args(["serve", "--gpus", "all", "--tensor-parallel", "2"])
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    specs = build_children(args, flag_defaults(), env=env)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2,3", "4,5", "6,7"]
    assert all("--tensor-parallel=2" in s.argv for s in specs)
    with pytest.raises(ConfigError, match=r"3 GPUs .*not a multiple of --tensor-parallel 2"):
        build_children(parser.parse_args(["serve", "--gpus", "0,1,2", "--tensor-parallel", "2"]),
                       flag_defaults(), env={})  # fmt: skip


def test_info_names_a_workers_group() -> None:
    """``scoring-worker info`` shows a group's size and devices from its heartbeat."""
    from worker.commands.info import _workers
    from worker.daemon.heartbeat import INFO_FIELDS

    assert {"tensor_parallel", "tensor_parallel_devices"} <= set(INFO_FIELDS)
    beat = {
        "consumer": "node-a-0",
        "model": "/ckpt/rm-70b",
        "dtype": "bfloat16",
        "device": "cuda:0",
        "tensor_parallel": "2",
        "tensor_parallel_devices": ["cuda:0 (GPU 2)", "cuda:1 (GPU 3)"],
    }
    (line,) = _workers([beat])[2:]
    assert line.endswith("(bfloat16, cuda:0)  tensor parallel 2: cuda:0 (GPU 2), cuda:1 (GPU 3)")
