"""The compiled LM-head tile kernel (``worker.executor.head.native``): its build, cache and
fallback, and its fold against float64 and against the torch ops it replaces."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.models import random_tokens, tiny_causal
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.executor.head import native, tiles
from worker.executor.head.sums import OnlineLogSumExp
from worker.executor.head.teacher import chunked_token_outputs
from worker.executor.head.tiles import NativeFold
from worker.executor.head.topk import OnlineTopK
from worker.scorer import ScoreOptions
from worker.scorer.teacher import TokenOutputs

CC = os.environ.get("CC") or "cc"
needs_cc = pytest.mark.skipif(shutil.which(CC) is None, reason="no C compiler here")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has not tried the kernel yet, caching into ``tmp_path``."""
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setenv("SCORING_WORKER_CACHE", str(tmp_path))
    monkeypatch.delenv(native.ENV, raising=False)
    return tmp_path


@needs_cc
def test_build_is_cached_by_source_and_loads(fresh: Path, monkeypatch) -> None:
    first = native.build()
    assert first.parent == fresh and first.suffix == ".so"
    stamp = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert [p.name for p in fresh.iterdir()] == [first.name]  # no temp file left behind
    edited = fresh / "src" / "native_tiles.c"
    edited.parent.mkdir()
    edited.write_text(native.SOURCE.read_text() + "\n/* edited */\n")
    monkeypatch.setattr(native, "SOURCE", edited)
    assert native.build() != first  # another source, another build
    loaded = native.kernel()
    assert loaded is not None and loaded.path.parent == fresh


def test_no_compiler_falls_back_to_torch_with_one_warning(fresh: Path, monkeypatch, caplog):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(OSError, match="no C compiler"):
        native.build()
    with caplog.at_level(logging.WARNING, logger="worker.executor.head.native"):
        assert native.kernel() is None
        assert native.kernel() is None  # tried once per process
    assert [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()] == [
        "native LM-head tile kernel unavailable, using torch ops: "
        "no C compiler ('no-such-compiler-here' is not on PATH)"
    ]
    head, h, labels = _problem(vocab=300)
    got = tiles.tiled_token_logps(h, head, labels, tile=64)  # the torch path, same answer
    np.testing.assert_allclose(got, _reference(head, h).gather(1, labels[:, None])[:, 0], atol=1e-5)


@needs_cc
def test_a_failed_build_says_why(fresh: Path, monkeypatch) -> None:
    broken = fresh / "broken.c"
    broken.write_text("int sw_abi(void) { return }\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    with pytest.raises(OSError, match="failed") as err:
        native.build()
    assert "error" in str(err.value)
    assert not [p for p in fresh.iterdir() if p.suffix in (".so", ".tmp")]


@pytest.mark.parametrize("value", ["0", "off", "False", "no"])
def test_switched_off_by_the_environment(fresh: Path, monkeypatch, value: str) -> None:
    monkeypatch.setenv(native.ENV, value)
    assert not native.enabled() and native.kernel() is None
    assert not list(fresh.iterdir())  # nothing built


@needs_cc
def test_a_library_of_another_abi_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "other.c"
    src.write_text("int sw_abi(void) { return 99; }\n")
    lib = tmp_path / "other.so"
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    with pytest.raises(OSError, match="ABI 99"):
        native.NativeTiles(lib)


def _kernel() -> native.NativeTiles:
    if shutil.which(CC) is None:
        pytest.skip("no C compiler here")
    got = native.kernel()
    assert got is not None, "a compiler is here but the kernel did not build"
    return got


def test_bad_tiles_are_refused() -> None:
    kernel = _kernel()
    m, s = torch.zeros(2), torch.zeros(2)
    with pytest.raises(ValueError, match="refused"):
        kernel.reduce(torch.zeros(2, 3), 0, 0.0, m, s)  # factor must be > 0
    with pytest.raises(ValueError, match="refused"):
        kernel.reduce(torch.zeros(2, 0), 0, 1.0, m, s)  # an empty tile


def _problem(vocab: int, rows: int = 37, scale: float = 3.0, seed: int = 0):
    torch.manual_seed(seed)
    head = torch.nn.Linear(16, vocab)
    h = torch.randn(rows, 16) * scale
    return head, h, torch.randint(0, vocab, (rows,))


def _reference(head: torch.nn.Linear, h: torch.Tensor, t: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(
            (h.double() @ head.weight.double().t() + head.bias.double()) / t, 1
        )


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("k", "tile"), [(1, 7), (5, 64), (40, 16), (256, 1000)])
def test_fold_equals_float64_and_the_torch_fold(k: int, tile: int, threads: int) -> None:
    """Entropy, the running max and sum, the heap's top k (more than a tile holds, for k = 40
    over tiles of 16) and its tail; with one thread and with two."""
    kernel = _kernel()
    head, h, _ = _problem(vocab=700, scale=6.0)
    with torch.no_grad():
        z = (h @ head.weight.t() + head.bias).contiguous()
    z[3, :] = float("-inf")  # a row of -inf logits
    z[4, 100:] = float("-inf")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fold = NativeFold(kernel, 37, z.device, tiles.LOG2E / 0.7, entropy=True, k=k)
        for v0 in range(0, 700, tile):
            fold.fold_(z[:, v0 : v0 + tile].contiguous(), v0)
    finally:
        torch.set_num_threads(before)
    acc = OnlineLogSumExp(37, z.device, entropy=True)
    online = OnlineTopK(37, k, z.device)
    for v0 in range(0, 700, tile):
        y = z[:, v0 : v0 + tile] * (tiles.LOG2E / 0.7)
        found = online.candidates(y)
        online.add_(found, acc.add_(y, online.row_max), v0, acc)
    online.finish(acc)
    live = torch.ones(37, dtype=torch.bool)
    live[3] = False
    lp = torch.log_softmax(z[live].double() / 0.7, 1)
    top = lp.topk(k, dim=1)
    np.testing.assert_allclose(
        fold.lse()[live], torch.logsumexp(z[live].double() / 0.7, 1), atol=1e-5
    )
    np.testing.assert_allclose(
        fold.entropy()[live], -(lp.exp() * lp).nan_to_num().sum(1), atol=1e-5
    )
    values, order = fold.values.sort(dim=1, descending=True)
    ids = fold.ids.gather(1, order)
    lse2 = fold.lse2()[:, None]
    got = ((values - lse2) * tiles.LN2)[live]
    np.testing.assert_allclose(got, top.values, atol=1e-5)
    untied = (top.values[:, :-1] - top.values[:, 1:]).abs().min(1).values > 1e-6 if k > 1 else None
    if untied is not None:
        assert np.array_equal(ids[live][untied], top.indices[untied])
    else:
        assert np.array_equal(ids[live], top.indices)
    rest = lp.exp().scatter(1, top.indices, 0.0).sum(1)
    finite = rest > 0  # row 4 has 100 live ids: with k = 256 nothing is left outside
    tail = (fold.tail.log() - fold.s.log())[live]
    np.testing.assert_allclose(tail[finite], rest[finite].log(), rtol=1e-4, atol=1e-5)
    # the torch fold gives the same numbers
    np.testing.assert_allclose(fold.lse2()[live], acc.lse2()[live], atol=1e-5)
    np.testing.assert_allclose(fold.entropy()[live], acc.entropy()[live], atol=1e-5)
    np.testing.assert_allclose(values[live], online.values[live], atol=1e-5)
    assert torch.isneginf(fold.lse2()[3]) and not torch.isnan(fold.entropy()[4])


def test_executor_native_and_torch_folds_agree_and_logps_are_the_teachers() -> None:
    """The executor's default (the kernel, where it builds) and ``native_head=False`` give the
    same log-probs and teacher outputs; a teacher job's log-probs are bit-identical to a
    log-probs job's."""
    _kernel()
    model = tiny_causal("llama", vocab_size=3000)
    seqs = [SequenceInput(random_tokens(40, seed=i, vocab=3000), prompt_len=10) for i in range(4)]
    spec = TokenOutputs(("logps", "entropy", "topk"), topk=16)
    runs = {}
    for flag in (True, False):
        ex = StatelessExecutor(ExecutorConfig(native_head=flag), model)
        plain = ex.score(seqs).scores
        teacher = ex.score(seqs, options=ScoreOptions(outputs=spec)).scores
        for a, b in zip(plain, teacher, strict=True):
            assert np.array_equal(a.logps, b.logps)
        runs[flag] = teacher
        ex.close()
    for a, b in zip(runs[True], runs[False], strict=True):
        np.testing.assert_allclose(a.logps, b.logps, atol=1e-5)
        for name in ("entropy", "topk_logps", "topk_tail_logp"):
            np.testing.assert_allclose(a.arrays[name], b.arrays[name], atol=1e-5, rtol=1e-5)


def test_native_head_validated() -> None:
    from worker.errors import ConfigError

    with pytest.raises(ConfigError, match="native_head"):
        ExecutorConfig(native_head="yes")  # type: ignore[arg-type]


def test_the_fold_is_used_when_the_kernel_is_there(monkeypatch) -> None:
    """With the kernel loaded the tiles call it for log-probs and for teacher outputs; with
    ``native_ok=False`` they do not."""
    kernel = _kernel()
    calls = []
    real = kernel.reduce
    monkeypatch.setattr(kernel, "reduce", lambda *a, **k: calls.append(1) or real(*a, **k))
    head, h, labels = _problem(vocab=300)
    tiles.tiled_token_logps(h, head, labels, tile=100)
    assert len(calls) == 3
    spec = TokenOutputs(("logps", "topk"), topk=3)
    chunked_token_outputs(h, head, labels, spec, vocab_tile=100, chunk_rows=20)
    assert len(calls) == 3 + 3 * 2  # two chunks of rows, three tiles each
    tiles.tiled_token_logps(h, head, labels, tile=100, native_ok=False)
    chunked_token_outputs(h, head, labels, spec, vocab_tile=100, native_ok=False)
    assert len(calls) == 9


@needs_cc
def test_a_read_only_cache_falls_back_to_the_temp_directory(fresh: Path, monkeypatch) -> None:
    locked = fresh / "locked"
    locked.mkdir()
    monkeypatch.setenv("SCORING_WORKER_CACHE", str(locked))
    monkeypatch.setattr(native.os, "access", lambda path, mode: Path(path) != locked)
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(fresh / "tmp"))
    built = native.build()
    assert built.parent == fresh / "tmp" / f"scoring-worker-{os.getuid()}"
    assert not list(locked.iterdir())


def test_the_executor_says_how_its_lm_head_runs(monkeypatch) -> None:
    """``info["lm_head"]`` (and ``scoring_build_info``'s label): the kernel's tiles where it
    builds, torch's tiles where it is off or missing, blocks without tiles."""
    from worker.commands.serve import build_info

    _kernel()
    model = tiny_causal("llama")
    paths = {}
    for name, config in {
        "default": ExecutorConfig(),
        "off": ExecutorConfig(native_head=False),
        "blocks": ExecutorConfig(head_vocab_tile=0),
    }.items():
        ex = StatelessExecutor(config, model)
        paths[name] = ex.info["lm_head"]
        ex.close()
    assert paths == {"default": "native tiles", "off": "torch tiles", "blocks": "blocks"}
    monkeypatch.setenv(native.ENV, "0")
    ex = StatelessExecutor(ExecutorConfig(), model)
    assert ex.info["lm_head"] == "torch tiles"

    class Wrapped:
        info = ex.info

    assert build_info(Wrapped())["lm_head"] == "torch tiles"  # type: ignore[arg-type]
    ex.close()


def test_loading_the_kernel_leaves_the_floating_point_state_alone() -> None:
    """A library linked with -ffast-math sets flush-to-zero for the whole process at load; the
    kernel must not: subnormals stay representable for torch, numpy and Python."""
    _kernel()
    tiny = 5e-324  # the smallest double subnormal
    assert tiny * 1.0 > 0.0
    assert float(torch.tensor([1e-40], dtype=torch.float32) * 1.0) > 0.0
    assert np.float32(1e-45) * np.float32(1.0) > 0
