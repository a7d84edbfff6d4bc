"""Vocabulary-tiled LM head (``worker.executor.head.tiles``) against float64 references.

The running logsumexp, entropy and top-k over ``[rows, tile]`` slices must equal the same
reductions over the whole vocabulary: tiles of 1 (every id its own tile), ragged last tiles,
a tile wider than the vocabulary, a bias, a softcap and a scale, T != 1, ``-inf`` logits, and
peaked rows whose tail outside the top k is tiny. ``tileable`` decides when the head may be cut.
Each reduction runs twice: folded by the compiled kernel (``native.py``) and by torch ops.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from tests.support.models import random_tokens, tiny_causal
from worker.errors import ConfigError
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.executor.head import native, tiles
from worker.executor.head.logprobs import LogitTransform, chunked_token_logps
from worker.executor.head.sums import OnlineLogSumExp
from worker.executor.head.teacher import chunked_token_outputs
from worker.executor.head.tiles import tileable, tiled_token_logps
from worker.scorer import ScoreOptions
from worker.scorer.teacher import TokenOutputs

ATOL = 1e-5


@pytest.fixture(params=["native", "torch"])
def native_ok(request) -> bool:
    """Which fold the tiles take: the compiled kernel (it must build where a compiler is) or
    torch ops."""
    if request.param == "torch":
        return False
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler: the native kernel cannot be built here")
    assert native.kernel() is not None, "a compiler is here but the native kernel did not load"
    return True


def _head(vocab: int, hidden: int = 16, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(hidden, vocab, bias=bias)


def _reference(head: nn.Linear, h: torch.Tensor, transform: LogitTransform, t: float):
    """float64 ``log_softmax(transform(head(h)) / T)`` ``[N, V]``."""
    with torch.no_grad():
        z = head.double()(h.double())
        head.float()
    return torch.log_softmax(transform.apply_(z) / t, dim=-1)


@pytest.mark.parametrize("tile", [1, 7, 64, 1000])
@pytest.mark.parametrize(
    "transform",
    [LogitTransform(), LogitTransform(softcap=4.0), LogitTransform(scale=2.5, divisor=1.5)],
    ids=["plain", "softcap", "scale"],
)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_tiled_logps_equal_float64(
    tile: int, transform: LogitTransform, temperature: float, native_ok: bool
) -> None:
    head = _head(200)
    h = torch.randn(23, 16) * 3
    labels = torch.randint(0, 200, (23,))
    got = tiled_token_logps(
        h,
        head,
        labels,
        temperature=temperature,
        chunk_tokens=5,
        tile=tile,
        transform=transform,
        native_ok=native_ok,
    )
    want = _reference(head, h, transform, temperature).gather(1, labels[:, None]).squeeze(1)
    assert got.dtype == torch.float32 and got.shape == (23,)
    np.testing.assert_allclose(got.detach().numpy(), want.numpy(), atol=ATOL)


@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(softcap=4.0)])
def test_half_precision_head_tiles_equal_its_own_logits(
    transform: LogitTransform, native_ok: bool
) -> None:
    """A bfloat16 head: each tile's logits are made in bfloat16, then widened to float32 and
    scaled to base 2."""
    head = _head(200).to(torch.bfloat16)
    h = (torch.randn(23, 16) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 200, (23,))
    got = tiled_token_logps(
        h, head, labels, temperature=0.6, tile=64, transform=transform, native_ok=native_ok
    )
    with torch.no_grad():
        z = transform.apply_(head(h).double()) / 0.6  # the head's own bfloat16 logits
    want = torch.log_softmax(z, dim=-1).gather(1, labels[:, None]).squeeze(1)
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=ATOL)


def test_minus_inf_logits_are_skipped_not_nan(native_ok: bool) -> None:
    head = _head(20, bias=True)
    with torch.no_grad():
        head.bias[:8] = float("-inf")  # the first tiles of 3 are all -inf for every row
    h = torch.randn(6, 16)
    labels = torch.tensor([10, 11, 19, 12, 15, 2])
    got = tiled_token_logps(h, head, labels, tile=3, native_ok=native_ok).detach()
    want = chunked_token_logps(h, head, labels).detach()
    assert torch.isneginf(got[5]) and torch.isfinite(got[:5]).all()
    np.testing.assert_allclose(got[:5].numpy(), want[:5].numpy(), atol=ATOL)
    spec = TokenOutputs(("logps", "entropy", "topk"), topk=4)
    tiled = chunked_token_outputs(h, head, labels, spec, vocab_tile=3, native_ok=native_ok)
    blocks = chunked_token_outputs(h, head, labels, spec, vocab_tile=0)
    for name, value in tiled.items():
        assert not torch.isnan(value.float()).any(), name
        np.testing.assert_allclose(value.numpy(), blocks[name].numpy(), atol=ATOL)


def test_online_logsumexp_and_entropy_over_uneven_tiles() -> None:
    torch.manual_seed(3)
    z = torch.randn(9, 50) * 6
    acc = OnlineLogSumExp(9, z.device, entropy=True)
    for lo, hi in ((0, 1), (1, 17), (17, 18), (18, 50)):
        acc.add_(z[:, lo:hi] * tiles.LOG2E)  # base-2 logits, as head_tiles yields them
    lp = torch.log_softmax(z.double(), dim=1)
    np.testing.assert_allclose(acc.lse(), torch.logsumexp(z.double(), 1), atol=ATOL)
    np.testing.assert_allclose(acc.entropy(), -(lp.exp() * lp).sum(1), atol=ATOL)


@pytest.mark.parametrize(
    ("tile", "vocab"), [(1, 120), (6, 120), (33, 120), (500, 120), (32, 120), (64, 2048)]
)
@pytest.mark.parametrize("peaked", [False, True])
def test_tiled_teacher_outputs_equal_float64(
    tile: int, vocab: int, peaked: bool, native_ok: bool
) -> None:
    """Top-k (values, ids where untied, the tail summed directly), entropy, shared and
    per-position gather; peaked rows put almost all mass in the top k (a tiny tail). Tiles of
    32 and 64 take the grouped candidate filter (a multiple of ``GROUP``; the last tile of 24
    of V = 120 does not), V = 2,048 merges candidates many times."""
    head = _head(vocab)
    h = torch.randn(31, 16) * (25.0 if peaked else 2.0)
    labels = torch.randint(0, vocab, (31,))
    per_row = torch.randint(0, vocab, (31, 3))
    transform = LogitTransform(softcap=30.0)
    lp = _reference(head, h, transform, 0.8)  # [N, V] float64
    top = lp.topk(10, dim=1)
    mass = lp.exp().scatter(1, top.indices, 0.0).sum(1)
    for ids, shared in ((per_row, ()), (None, (0, 5, vocab - 1, 5))):
        spec = TokenOutputs(
            ("logps", "entropy", "topk", "gather"),
            topk=10,
            gather_ids=shared,
            gather_width=0 if shared else 3,
            temperature=0.8,
        )
        got = chunked_token_outputs(
            h, head, labels, spec, transform=transform, gather_ids=ids, vocab_tile=tile,
            chunk_rows=8, native_ok=native_ok,
        )  # fmt: skip
        np.testing.assert_allclose(got["logps"], lp.gather(1, labels[:, None])[:, 0], atol=ATOL)
        np.testing.assert_allclose(got["entropy"], -(lp.exp() * lp).sum(1), atol=ATOL)
        np.testing.assert_allclose(got["topk_logps"], top.values, atol=ATOL)
        untied = (top.values[:, :-1] - top.values[:, 1:]).abs().min(1).values > 1e-6
        assert untied.any()
        assert np.array_equal(got["topk_ids"][untied], top.indices[untied].int())
        np.testing.assert_allclose(got["topk_tail_logp"], mass.log(), rtol=1e-4, atol=ATOL)
        want_ids = per_row if ids is not None else torch.tensor(shared).expand(31, -1)
        np.testing.assert_allclose(got["gather_logps"], lp.gather(1, want_ids), atol=ATOL)
    if peaked and vocab == 120:  # the direct tail sum keeps masses 1 - sum(top) would lose
        assert float(mass.min()) < 1e-5  # 1 - sum in float32 would be off by ~5% there


def test_tileable_only_plain_linear_with_idle_hooks() -> None:
    head = _head(10)
    assert tileable(head)
    assert not tileable(None) and not tileable(nn.Sequential(head))

    class Scaled(nn.Linear):
        pass

    assert not tileable(Scaled(4, 4))

    def busy(module, args, output):
        return output * 2

    handle = head.register_forward_hook(busy)
    assert not tileable(head)  # a hook that edits the output must see the whole of it
    handle.remove()

    def observer(module, args, output):
        return None

    observer.idle = lambda: True  # type: ignore[attr-defined]
    handle = head.register_forward_pre_hook(observer)
    assert tileable(head)
    observer.idle = lambda: False  # type: ignore[attr-defined]
    assert not tileable(head)
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(busy)
    try:
        assert not tileable(head)
    finally:
        handle.remove()


def test_executor_default_tiles_on_cpu_and_equals_blocks(monkeypatch) -> None:
    model = tiny_causal("llama")
    seqs = [SequenceInput(random_tokens(n, n), prompt_len=3) for n in (9, 20, 14)]
    calls: list[int] = []
    real = tiles.tiled_token_logps

    def spy(*args, **kwargs):
        calls.append(kwargs["tile"])
        return real(*args, **kwargs)

    monkeypatch.setattr("worker.executor.forward.tiled_token_logps", spy)
    built = [StatelessExecutor(ExecutorConfig(head_vocab_tile=t), model) for t in (None, 0, 7)]
    calls.clear()  # the load probe scores too
    tiled, blocks, small = (ex.score(seqs).scores for ex in built)
    # one forward per distinct length on CPU; None: the CPU default; 0: whole-vocabulary blocks
    assert calls == [1024] * 3 + [7] * 3
    for a, b, c in zip(tiled, blocks, small, strict=True):
        np.testing.assert_allclose(a.logps, b.logps, atol=ATOL)
        np.testing.assert_allclose(c.logps, b.logps, atol=ATOL)


def test_lora_on_the_head_takes_the_blocks(tmp_path, monkeypatch) -> None:
    """An adapter with a delta on ``lm_head`` must see the whole head output: its jobs go
    through the blocks (the hook is not idle), base jobs and q/v-only adapters through tiles."""
    from tests.support.adapters import merged_float64, naive_logps, save_lora
    from worker.executor.weights.residency import WeightsConfig

    base = tiny_causal("llama", seed=0)
    base.save_pretrained(str(tmp_path / "base"))
    save_lora(base, tmp_path / "adapters" / "head", seed=5, targets=("q_proj", "lm_head"))
    save_lora(base, tmp_path / "adapters" / "qv", seed=6, targets=("q_proj", "v_proj"))
    ex = StatelessExecutor.from_pretrained(
        ExecutorConfig(),
        str(tmp_path / "base"),
        weights=WeightsConfig(adapter_root=str(tmp_path / "adapters")),
    )
    calls: list[str | None] = []
    real = tiles.tiled_token_logps

    def spy(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr("worker.executor.forward.tiled_token_logps", spy)
    seqs = [SequenceInput(random_tokens(n, n), prompt_len=3) for n in (12, 7)]
    for name in ("head", None, "qv"):
        out = ex.score(seqs, options=ScoreOptions(adapter=name))
        model = base if name is None else merged_float64(base, tmp_path / "adapters" / name)
        for s, got in zip(seqs, out.scores, strict=True):
            np.testing.assert_allclose(got.logps, naive_logps(model, s.tokens, 3), atol=1e-4)
    assert calls == [None, None, "qv", "qv"]  # one forward per length; "head": the blocks
    ex.close()


@pytest.mark.parametrize("bad", [-1, 1.5, "1024", True])
def test_head_vocab_tile_validated(bad) -> None:
    with pytest.raises(ConfigError, match="head_vocab_tile"):
        ExecutorConfig(head_vocab_tile=bad)


def test_vocab_tile_per_device() -> None:
    assert ExecutorConfig().vocab_tile("cpu") == 1024
    assert ExecutorConfig().vocab_tile("cuda") == 0
    assert ExecutorConfig(head_vocab_tile=0).vocab_tile("cpu") == 0
    assert ExecutorConfig(head_vocab_tile=256).vocab_tile("cuda") == 256
