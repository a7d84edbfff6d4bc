"""The tensor-parallel pieces that need no second process: the vocabulary-parallel LM head
(every shard of one head built in one process, combined, against the one-process teacher
outputs and the naive float64 log-softmax), the vote's mirroring of a failure, and the plan's
refusals with the numbers and the sizes that work."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.models import tiny_config
from worker.errors import BadRequest, ConfigError, ScoringError
from worker.executor import backends
from worker.executor.head.logprobs import LogitTransform, naive_token_logps
from worker.executor.head.teacher import chunked_token_outputs
from worker.executor.parallel.forward import describe, mirror
from worker.executor.parallel.head import Columns, combine, fold_shard, vocab_shard
from worker.executor.parallel.plan import device_check, tensor_parallel_plan, working_sizes
from worker.scorer.teacher import TokenOutputs

V, H, N = 96, 16, 37


def _sharded(
    head: nn.Linear,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    spec: TokenOutputs,
    size: int,
    *,
    gather: torch.Tensor | None = None,
    transform: LogitTransform | None = None,
    chunk_rows: int = 10,
) -> dict[str, torch.Tensor]:
    """What a group of ``size`` ranks returns: each shard folded, stacked, combined."""
    cols = Columns.of(spec)
    if gather is None and spec.gather_ids:
        gather = torch.tensor(spec.gather_ids)
    stats = [
        fold_shard(hidden, vocab_shard(head, r, size), labels, cols,
                   temperature=spec.temperature, transform=transform or LogitTransform(),
                   gather_ids=gather, chunk_rows=chunk_rows)
        for r in range(size)
    ]  # fmt: skip
    return combine(torch.stack(stats), cols, spec)


@pytest.fixture
def case() -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    head = nn.Linear(H, V, bias=True)
    return head, torch.randn(N, H) * 3, torch.randint(0, V, (N,))


SPECS = {
    "logps": TokenOutputs(),
    "teacher": TokenOutputs(frozenset({"logps", "entropy", "topk"}), topk=7, temperature=0.7),
    "k over a shard": TokenOutputs(
        frozenset({"entropy", "topk", "gather"}), topk=60, gather_ids=(1, 5, 95)
    ),
}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shards_combined_equal_one_process(
    case: tuple[nn.Linear, torch.Tensor, torch.Tensor], name: str, size: int
) -> None:
    """Every output of every spec, any group size (k = 60 is more than a shard of 24 ids
    holds at size 4: the shards pad their candidates); softcap transform included."""
    head, hidden, labels = case
    spec, transform = SPECS[name], LogitTransform(softcap=5.0)
    want = chunked_token_outputs(hidden, head, labels, spec, transform=transform)
    got = _sharded(head, hidden, labels, spec, size, transform=transform)
    assert set(got) == set(want)
    for key, value in want.items():
        if key == "topk_ids":
            assert torch.equal(got[key], value)
        else:
            torch.testing.assert_close(got[key], value, atol=2e-6, rtol=0, msg=key)


def test_per_position_gather_and_the_naive_reference(
    case: tuple[nn.Linear, torch.Tensor, torch.Tensor],
) -> None:
    head, hidden, labels = case
    ids = torch.randint(0, V, (N, 5))
    spec = TokenOutputs(frozenset({"logps", "gather"}), gather_width=5)
    got = _sharded(head, hidden, labels, spec, 2, gather=ids)
    logits = head(hidden).detach().double()  # the naive reference, in float64
    lp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(
        got["logps"].double(), lp.gather(1, labels[:, None])[:, 0], atol=2e-6, rtol=0
    )
    torch.testing.assert_close(naive_token_logps(logits, labels), got["logps"], atol=2e-6, rtol=0)
    want = lp.gather(1, ids)
    torch.testing.assert_close(got["gather_logps"].double(), want, atol=2e-6, rtol=0)


def test_a_shard_holds_one_block_of_its_own_width(
    case: tuple[nn.Linear, torch.Tensor, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The only logits a rank makes are ``[chunk_rows, V / size]`` blocks (never ``[N, V]``),
    and its statistics are ``[N, C]`` with C = 3 for log-probs."""
    head, hidden, labels = case
    shard = vocab_shard(head, 1, 4)
    assert (shard.v0, shard.width, shard.vocab) == (24, 24, V)
    shapes: list[tuple[int, ...]] = []
    real = type(shard).logits

    def logits(self: object, *args: object) -> torch.Tensor:
        z = real(self, *args)  # type: ignore[arg-type]
        shapes.append(tuple(z.shape))
        return z

    monkeypatch.setattr(type(shard), "logits", logits)
    stats = fold_shard(hidden, shard, labels, Columns(), temperature=1.0,
                       transform=LogitTransform(), gather_ids=None, chunk_rows=16)  # fmt: skip
    assert stats.shape == (N, 3)
    assert shapes == [(16, 24), (16, 24), (5, 24)]


def test_a_failure_on_one_rank_is_the_same_kind_of_failure_on_all() -> None:
    oom = torch.OutOfMemoryError("CUDA out of memory")
    bad = BadRequest("gather ids out of range")
    boom = ValueError("a bug")
    # one rank ran out of memory: the others raise an OOM too (the runner halves on all)
    raised = mirror([None, describe(oom, 1)], None)
    assert isinstance(raised, torch.OutOfMemoryError) and "rank 1" in str(raised)
    assert mirror([None, describe(oom, 1)], oom) is oom  # the failing rank keeps its own
    # the worst kind wins everywhere: an error beats a request error beats an OOM
    worst = mirror([describe(oom, 0), describe(bad, 1)], oom)
    assert isinstance(worst, ScoringError) and worst.code == "bad_request"
    assert not isinstance(mirror([describe(boom, 0), describe(bad, 1)], bad), ScoringError)
    # a kernel failure's stand-in makes the other ranks fall back too
    kernel = RuntimeError("flash kernel failed")
    kernel.attention_kernel_error = True  # type: ignore[attr-defined]
    stand_in = mirror([describe(kernel, 0), None], None)
    assert backends.is_attention_kernel_error(stand_in)  # type: ignore[arg-type]


def test_the_plan_refuses_sizes_that_split_a_head() -> None:
    llama = tiny_config("llama")  # 4 heads, 2 KV heads, vocabulary 96
    assert tensor_parallel_plan(llama, 2, name="ref").shard_vocab == 48
    with pytest.raises(ConfigError) as err:
        tensor_parallel_plan(llama, 4, name="ref")
    text = str(err.value)
    assert "4 attention heads, 2 KV heads and a vocabulary of 96" in text
    assert text.endswith("Sizes that work: 1, 2")
    assert working_sizes(64, 8, 128_256) == [1, 2, 4, 8]
    with pytest.raises(ConfigError, match="vocabulary of 97"):
        tensor_parallel_plan(tiny_config("llama", vocab=97), 2)
    with pytest.raises(ConfigError, match="no tensor-parallel plan"):
        tensor_parallel_plan(tiny_config("gpt2"), 2)


def test_the_plan_refuses_a_vision_language_model() -> None:
    """Images are not served by a group: a vision-language checkpoint is refused at load,
    named as such, even where its language model has a plan and the sizes divide."""
    from worker.demo.tiny import tiny_vlm

    model, _ = tiny_vlm("qwen2_vl", seed=0)
    assert model.config.get_text_config().base_model_tp_plan  # the language model has one
    with pytest.raises(ConfigError, match="is a vision-language model; images are not served"):
        tensor_parallel_plan(model.config, 2, name="vlm")


def test_more_ranks_than_devices_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"needs 4 GPUs .* sees 2"):
        device_check(4, "cuda", 2, 64)
    with pytest.raises(ConfigError, match="names one GPU"):
        device_check(2, "cuda:1", 8, 64)
    with pytest.raises(ConfigError, match="core per rank"):
        device_check(8, "cpu", 0, 2)
    device_check(2, "cpu", 0, 2)
    device_check(4, "auto", 8, 2)


def test_outputs_a_group_cannot_fold_yet_are_refused_per_job() -> None:
    """``rank`` and a sampler's ``processed_logps`` need the whole distribution on one rank: a
    job asking for them gets ``bad_request`` naming what a group serves."""
    from worker.errors import BadRequest
    from worker.executor.parallel.executor import refuse_unsharded
    from worker.scorer import ScoreOptions
    from worker.scorer.teacher import Sampling, TokenOutputs

    rank = TokenOutputs(outputs=frozenset({"logps", "rank"}))
    sampled = TokenOutputs(outputs=frozenset({"processed_logps"}), sampling=Sampling(top_k=5))
    for spec, word in ((rank, "rank"), (sampled, "processed_logps")):
        with pytest.raises(BadRequest, match=word):
            refuse_unsharded(ScoreOptions(outputs=spec))
    refuse_unsharded(ScoreOptions(outputs=TokenOutputs(outputs=frozenset({"logps", "entropy"}))))
