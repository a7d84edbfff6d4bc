"""Teacher outputs (entropy, top-k, gather, sampler-processed log-probs) agree with a naive float64
reference over the full vocabulary, chunk by byte budget, and never build an ``[N, V]`` block."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from worker.errors import BadRequest
from worker.executor.head.logprobs import LogitTransform, chunked_token_logps
from worker.executor.head.sampling import Sampling
from worker.executor.head.teacher import (
    BASE_UNITS,
    DEFAULT_BUDGET_BYTES,
    SORT_UNITS,
    TokenOutputs,
    block_units,
    chunk_rows_for,
    chunked_token_outputs,
    result_bytes,
)

ALL = frozenset({"logps", "entropy", "topk", "gather", "processed_logps"})
ATOL = 1e-4


def _head(hidden: int = 16, vocab: int = 600, seed: int = 0, std: float = 0.5) -> nn.Linear:
    torch.manual_seed(seed)
    head = nn.Linear(hidden, vocab, bias=False)
    nn.init.normal_(head.weight, std=std)
    return head


def _inputs(n: int, hidden: int = 16, vocab: int = 600, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, hidden, generator=gen), torch.randint(0, vocab, (n,), generator=gen)


def _naive_keep(p: torch.Tensor, s: Sampling) -> torch.Tensor:
    """HF TopK -> TopP -> MinP warpers on probabilities ``[N, V]``, ties at each boundary kept."""
    keep = torch.ones_like(p, dtype=torch.bool)
    if s.top_k and s.top_k < p.shape[1]:
        keep &= p >= p.topk(s.top_k, dim=1).values[:, -1:]
    if s.top_p < 1.0:
        q = torch.where(keep, p, 0.0)
        q = q / q.sum(1, keepdim=True)
        sq = q.sort(dim=1, descending=True).values
        before = sq.cumsum(1) - sq  # mass strictly before each sorted token
        last = (before < s.top_p).sum(1, keepdim=True) - 1
        keep &= q >= sq.gather(1, last)
    if s.min_p > 0.0:
        keep &= p >= s.min_p * p.amax(1, keepdim=True)
    return keep


def _naive(
    logits: torch.Tensor,
    labels: torch.Tensor,
    spec: TokenOutputs,
    transform: LogitTransform | None = None,
    gather_ids: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Every output from the full float64 ``log_softmax(transform(logits) / T)``."""
    x = logits.double()  # [N, V]
    t = transform or LogitTransform()
    if t.scale is not None:
        x = x * t.scale
    if t.divisor is not None:
        x = x / t.divisor
    if t.softcap is not None:
        x = t.softcap * torch.tanh(x / t.softcap)
    x = x / spec.temperature
    lp = torch.log_softmax(x, dim=-1)  # [N, V]
    out = {
        "logps": lp.gather(1, labels[:, None])[:, 0],
        "entropy": -torch.where(lp.isneginf(), 0.0, lp.exp() * lp).sum(-1),
    }
    if spec.topk:
        values, ids = lp.topk(spec.topk, dim=1)
        out["topk_logps"], out["topk_ids"] = values, ids
        # log1p(-exp(values).sum(-1)), summed over the complement so that float64 resolves it too.
        out["topk_tail_logp"] = lp.scatter(1, ids, -math.inf).logsumexp(-1)
    if spec.gather_ids:
        out["gather_logps"] = lp[:, list(spec.gather_ids)]
    elif gather_ids is not None:
        out["gather_logps"] = lp.gather(1, gather_ids.long())
    if spec.sampling is not None:
        keep = _naive_keep(lp.exp(), spec.sampling)
        masked = torch.log_softmax(x.masked_fill(~keep, -math.inf), dim=-1)
        out["processed_logps"] = masked.gather(1, labels[:, None])[:, 0]
    return out


def _check(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], spec: TokenOutputs) -> None:
    expected = {"topk_ids", "topk_logps", "topk_tail_logp"} if "topk" in spec.outputs else set()
    expected |= spec.outputs - {"topk", "gather"}
    expected |= {"gather_logps"} if "gather" in spec.outputs else set()
    assert set(got) == expected
    for name, value in got.items():
        assert value.dtype == (torch.int32 if name == "topk_ids" else torch.float32), name
        if name == "topk_ids":
            continue
        ref = want[name]
        assert value.shape == ref.shape, name
        both_inf = torch.isneginf(value) & torch.isneginf(ref)
        assert torch.equal(torch.isneginf(value), torch.isneginf(ref)), name
        diff = (value.double() - ref).abs().masked_fill(both_inf, 0.0)
        assert diff.max().item() < ATOL, (name, diff.max().item())
    if "topk" in spec.outputs:
        _check_topk_ids(got, want)


def _check_topk_ids(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Ids equal where the reference's values are not (near-)tied; values descend."""
    ref_values = want["topk_logps"]
    gaps = (ref_values[:, :-1] - ref_values[:, 1:]).abs()  # [N, k-1]
    untied = torch.ones_like(ref_values, dtype=torch.bool)
    untied[:, :-1] &= gaps > 1e-5
    untied[:, 1:] &= gaps > 1e-5
    assert torch.equal(got["topk_ids"].long()[untied], want["topk_ids"][untied])
    assert bool((got["topk_logps"][:, :-1] >= got["topk_logps"][:, 1:]).all())


def _run_and_compare(
    head: nn.Module,
    spec: TokenOutputs,
    n: int = 23,
    transform: LogitTransform | None = None,
    gather_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    **kwargs: int,
) -> dict[str, torch.Tensor]:
    vocab = head.out_features
    hidden, random_labels = _inputs(n, vocab=vocab)
    labels = random_labels if labels is None else labels
    with torch.inference_mode():
        got = chunked_token_outputs(
            hidden, head, labels, spec, transform=transform, gather_ids=gather_ids, **kwargs
        )
        want = _naive(head(hidden), labels, spec, transform, gather_ids)
    _check(got, want, spec)
    return got


@pytest.mark.parametrize("chunk_rows", [1, 5, 7, 23, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_all_outputs_match_naive_float64_at_any_chunking(
    chunk_rows: int, temperature: float
) -> None:
    spec = TokenOutputs(
        ALL,
        topk=8,
        gather_ids=(0, 5, 599, 5),
        temperature=temperature,
        sampling=Sampling(top_k=40, top_p=0.8, min_p=0.05),
    )
    _run_and_compare(_head(), spec, chunk_rows=chunk_rows)


@pytest.mark.parametrize(
    "transform",
    [LogitTransform(softcap=2.0), LogitTransform(scale=3.0), LogitTransform(divisor=0.25)],
)
def test_logit_transform_applies_before_temperature_to_every_output(
    transform: LogitTransform,
) -> None:
    spec = TokenOutputs(
        ALL, topk=16, gather_ids=(3, 1), temperature=0.8, sampling=Sampling(top_p=0.9, min_p=0.02)
    )
    _run_and_compare(_head(std=2.0), spec, transform=transform, chunk_rows=6)


@pytest.mark.parametrize("chunk_rows", [1, 4, 1024])
def test_logps_equal_chunked_token_logps(chunk_rows: int) -> None:
    head = _head()
    hidden, labels = _inputs(19)
    transform = LogitTransform(softcap=3.0)
    spec = TokenOutputs(ALL, topk=4, gather_width=2, temperature=0.7, sampling=Sampling(top_k=3))
    ids = torch.zeros(19, 2, dtype=torch.int32)
    with torch.inference_mode():
        got = chunked_token_outputs(
            hidden, head, labels, spec, transform=transform, gather_ids=ids, chunk_rows=chunk_rows
        )
        want = chunked_token_logps(
            hidden, head, labels, temperature=0.7, chunk_tokens=chunk_rows, transform=transform
        )
    assert torch.equal(got["logps"], want)


@pytest.mark.parametrize("k", [1, 2, 255, 256])
def test_topk_at_the_ends_of_its_range(k: int) -> None:
    got = _run_and_compare(_head(vocab=600), TokenOutputs({"topk"}, topk=k), chunk_rows=7)
    assert got["topk_ids"].shape == (23, k)
    assert bool((got["topk_tail_logp"] < 0).all())


def test_tail_is_minus_inf_when_the_top_k_hold_all_the_mass() -> None:
    head = _head(vocab=200)
    got = _run_and_compare(head, TokenOutputs({"topk", "logps"}, topk=200), chunk_rows=5)
    assert bool(torch.isneginf(got["topk_tail_logp"]).all())
    assert torch.allclose(got["topk_logps"].exp().sum(1), torch.ones(23), atol=1e-5)


def test_tail_of_a_peaked_distribution_is_exact_where_one_minus_sum_cancels() -> None:
    # std 6 makes the top token hold nearly all the mass: 1 - sum(top k) cancels in float32.
    head = _head(vocab=600, std=6.0)
    got = _run_and_compare(head, TokenOutputs({"topk"}, topk=4), chunk_rows=7)
    assert float(got["topk_tail_logp"].min()) < -20.0  # a tail float32 1 - sum could not resolve


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_per_position_gather_ids(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 600, (23, 9), generator=gen).to(dtype)
    spec = TokenOutputs({"gather", "logps"}, gather_width=9, temperature=1.3)
    got = _run_and_compare(_head(), spec, gather_ids=ids, chunk_rows=4)
    assert got["gather_logps"].shape == (23, 9)


def test_shared_gather_ids_equal_the_same_ids_given_per_position() -> None:
    head = _head()
    hidden, labels = _inputs(11)
    shared = TokenOutputs({"gather"}, gather_ids=(7, 0, 599))
    per_row = TokenOutputs({"gather"}, gather_width=3)
    ids = torch.tensor([[7, 0, 599]] * 11)
    with torch.inference_mode():
        a = chunked_token_outputs(hidden, head, labels, shared, chunk_rows=3)
        b = chunked_token_outputs(hidden, head, labels, per_row, gather_ids=ids, chunk_rows=3)
    assert torch.equal(a["gather_logps"], b["gather_logps"])
    _run_and_compare(head, shared, chunk_rows=4)


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(top_k=1),
        Sampling(top_k=20),
        Sampling(top_k=300),  # above 256: the sort path
        Sampling(top_k=600),  # the whole vocabulary: off
        Sampling(top_p=0.5),
        Sampling(top_p=0.95),
        Sampling(min_p=0.1),
        Sampling(min_p=1.0),  # only the argmax (and its ties)
        Sampling(top_k=50, top_p=0.7, min_p=0.2),
        Sampling(top_k=None, top_p=1.0, min_p=0.0),  # all off: processed == logps
    ],
)
def test_processed_logps_match_the_naive_sampler_support(sampling: Sampling) -> None:
    spec = TokenOutputs({"processed_logps", "logps"}, sampling=sampling, temperature=0.9)
    got = _run_and_compare(_head(std=1.5), spec, n=31, chunk_rows=6)
    if sampling.top_k in (0, 600) and sampling.top_p == 1.0 and sampling.min_p == 0.0:
        assert torch.equal(got["processed_logps"], got["logps"])


@pytest.mark.parametrize("top_k", [20, 300])
def test_top_p_runs_on_the_top_k_renormalised_distribution(top_k: int) -> None:
    # A flat distribution: the top k hold a small share, so top-p over the full distribution
    # would keep all k tokens while top-p over the renormalised top k keeps about half of them.
    head = _head(std=0.05)
    spec = TokenOutputs({"processed_logps"}, sampling=Sampling(top_k=top_k, top_p=0.5))
    hidden, _ = _inputs(9)
    with torch.inference_mode():
        labels = head(hidden).topk(top_k, dim=1).indices[:, -1]  # [N] the k-th token
    got = _run_and_compare(head, spec, n=9, labels=labels, chunk_rows=4)
    assert bool(torch.isneginf(got["processed_logps"]).all())


@pytest.mark.parametrize("sampling", [Sampling(top_k=5), Sampling(top_p=0.3), Sampling(min_p=0.5)])
def test_label_outside_the_support_gets_minus_inf(sampling: Sampling) -> None:
    head = _head(std=1.5)
    hidden, _ = _inputs(13)
    with torch.inference_mode():
        worst = head(hidden).argmin(dim=1)  # [N] never inside a top-5 / top-p 0.3 / min-p 0.5
        best = head(hidden).argmax(dim=1)  # [N] always inside
    spec = TokenOutputs({"processed_logps"}, sampling=sampling)
    got = _run_and_compare(head, spec, n=13, labels=worst, chunk_rows=4)
    assert bool(torch.isneginf(got["processed_logps"]).all())
    got = _run_and_compare(head, spec, n=13, labels=best, chunk_rows=4)
    assert bool((got["processed_logps"] <= 0).all())
    assert bool(torch.isfinite(got["processed_logps"]).all())


def _tied_head(vocab: int = 64) -> nn.Linear:
    """Tokens 0 and 1 share a weight row: their logits tie exactly, and they are the top two."""
    head = _head(vocab=vocab, std=0.1)
    with torch.no_grad():
        head.weight[1] = head.weight[0] = 3.0 * torch.ones(16) / 4.0
    return head


@pytest.mark.parametrize("sampling", [Sampling(top_k=1), Sampling(top_p=0.05)])
def test_ties_at_the_boundary_are_kept(sampling: Sampling) -> None:
    head = _tied_head()
    hidden = torch.ones(3, 16) + 0.01 * torch.randn(
        3, 16, generator=torch.Generator().manual_seed(0)
    )
    spec = TokenOutputs({"processed_logps"}, sampling=sampling)
    for label in (0, 1):
        labels = torch.full((3,), label)
        with torch.inference_mode():
            got = chunked_token_outputs(hidden, head, labels, spec, chunk_rows=2)
            want = _naive(head(hidden), labels, spec)
        # top-k 1 and a tiny top-p keep both tied tokens, each with half the kept mass.
        assert torch.allclose(got["processed_logps"], torch.full((3,), -math.log(2)), atol=1e-6)
        assert torch.allclose(got["processed_logps"].double(), want["processed_logps"], atol=1e-6)


def test_half_precision_head_reduces_in_float32() -> None:
    head = _head().to(torch.bfloat16)  # bf16 logits tie often: top-k compared on values
    hidden, labels = _inputs(17)
    hidden = hidden.to(torch.bfloat16)
    spec = TokenOutputs(ALL, topk=32, gather_ids=(1, 2), sampling=Sampling(top_k=64, top_p=0.9))
    with torch.inference_mode():
        got = chunked_token_outputs(hidden, head, labels, spec, chunk_rows=5)
        want = _naive(head(hidden), labels, spec)
    for name in ("logps", "entropy", "topk_logps", "topk_tail_logp", "gather_logps"):
        assert got[name].dtype == torch.float32
        assert torch.allclose(got[name].double(), want[name], atol=ATOL), name
    assert torch.allclose(got["processed_logps"].double(), want["processed_logps"], atol=ATOL)


def test_minus_inf_logits_from_a_masking_head() -> None:
    base = _head(vocab=100)

    class Masked(nn.Module):
        out_features = 100

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return base(x).index_fill(1, torch.arange(50, 100), -math.inf)

    head = Masked()
    hidden, labels = _inputs(9, vocab=100)
    spec = TokenOutputs(ALL, topk=60, gather_ids=(0, 99), sampling=Sampling(top_p=0.9))
    with torch.inference_mode():
        got = chunked_token_outputs(hidden, head, labels, spec, chunk_rows=4)
        want = _naive(head(hidden), labels, spec)
    assert bool(torch.isfinite(got["entropy"]).all())
    assert bool(torch.isneginf(got["topk_tail_logp"]).all())  # the 50 finite tokens are in it
    assert bool(torch.isneginf(got["gather_logps"][:, 1]).all())
    assert torch.equal(torch.isneginf(got["logps"]), labels >= 50)
    for name in ("entropy", "logps", "processed_logps"):
        finite = torch.isfinite(want[name])
        assert torch.allclose(got[name][finite].double(), want[name][finite], atol=ATOL), name


@pytest.mark.parametrize("masked_rows", ["all", "some"])
def test_minus_inf_logits_without_a_sampler(masked_rows: str) -> None:
    # Without a sampler the CPU path skips the clamp pass and redoes only the NaN entropy rows.
    base = _head(vocab=100)

    class Masked(nn.Module):
        out_features = 100

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            z = base(x)
            rows = x[:, 0] > 0 if masked_rows == "some" else torch.ones(len(x), dtype=torch.bool)
            z[rows, 50:] = -math.inf  # [c, V] the masked rows' upper half
            return z

    head = Masked()
    hidden, labels = _inputs(9, vocab=100)
    labels = labels % 50
    spec = TokenOutputs({"logps", "entropy", "topk"}, topk=8)
    with torch.inference_mode():
        got = chunked_token_outputs(hidden, head, labels, spec, chunk_rows=4)
        want = _naive(head(hidden), labels, spec)
    assert masked_rows == "all" or 0 < int((hidden[:, 0] > 0).sum()) < 9  # a mix of rows
    assert bool(torch.isfinite(got["entropy"]).all())
    for name in ("entropy", "logps", "topk_logps", "topk_tail_logp"):
        assert torch.allclose(got[name].double(), want[name], atol=ATOL), name


def test_empty_input_gives_empty_arrays() -> None:
    spec = TokenOutputs(ALL, topk=3, gather_ids=(1,), sampling=Sampling(top_k=2))
    with torch.inference_mode():
        got = chunked_token_outputs(
            torch.zeros(0, 16), _head(), torch.zeros(0, dtype=torch.long), spec
        )
    assert got["topk_ids"].shape == (0, 3)
    assert all(v.shape[0] == 0 for v in got.values())


# --- chunking and memory ---------------------------------------------------------------------


class _Recording(nn.Module):
    """A head that records the rows of each block it is asked for."""

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.head = head
        self.out_features = head.out_features
        self.rows: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return self.head(x)


def test_default_budget_fits_a_128k_vocabulary_in_128_mib() -> None:
    vocab = 128_256
    for sampling in (None, Sampling(top_k=50), Sampling(top_p=0.9)):
        outputs = {"logps", "processed_logps"} if sampling else {"logps"}
        units = block_units(TokenOutputs(outputs, sampling=sampling), vocab)
        rows = chunk_rows_for(vocab, DEFAULT_BUDGET_BYTES, units)
        assert rows * vocab * 4 * units <= DEFAULT_BUDGET_BYTES <= 128 * 2**20
        assert rows >= 32
    assert chunk_rows_for(vocab, 1, SORT_UNITS) == 1  # a budget under one row still makes progress


@pytest.mark.parametrize(
    ("sampling", "units"), [(Sampling(top_k=8), BASE_UNITS), (Sampling(top_p=0.9), SORT_UNITS)]
)
def test_blocks_follow_the_byte_budget(sampling: Sampling, units: float) -> None:
    vocab, budget = 1000, 100_000
    head = _Recording(_head(vocab=vocab))
    spec = TokenOutputs(ALL, topk=8, gather_ids=(1,), sampling=sampling)
    assert block_units(spec, vocab) == units
    hidden, labels = _inputs(50, vocab=vocab)
    with torch.inference_mode():
        chunked_token_outputs(hidden, head, labels, spec, budget_bytes=budget)
    rows = chunk_rows_for(vocab, budget, units)
    assert rows * vocab * 4 * units <= budget < (rows + 1) * vocab * 4 * units
    assert head.rows == [rows] * (50 // rows) + ([50 % rows] if 50 % rows else [])


def _peak_cpu_bytes(fn: Callable[[], object], trace: Path) -> int:
    """Peak bytes the CPU allocator held during ``fn``, from the profiler's memory events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    live = peak = 0
    for event in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        live += event["args"]["Bytes"]
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize(
    "sampling", [None, Sampling(top_k=8, min_p=0.01), Sampling(top_p=0.9)]
)  # None: the in-place path (FAST_UNITS)
def test_measured_peak_memory_stays_within_the_budget(
    sampling: Sampling | None, tmp_path: Path
) -> None:
    vocab, n, budget = 8192, 256, 2 * 2**20
    head = _head(vocab=vocab)
    hidden, labels = _inputs(n, vocab=vocab)
    outputs = ALL if sampling is not None else ALL - {"processed_logps"}
    spec = TokenOutputs(outputs, topk=16, gather_ids=(1, 2, 3), sampling=sampling)
    outputs = result_bytes(n, spec)

    def chunked() -> object:
        with torch.inference_mode():
            return chunked_token_outputs(hidden, head, labels, spec, budget_bytes=budget)

    def naive() -> object:
        with torch.inference_mode():
            return torch.log_softmax(head(hidden), dim=-1).topk(16, dim=1)

    peak = _peak_cpu_bytes(chunked, tmp_path / "chunked.json")
    assert budget / 4 < peak <= budget + outputs + 64 * 1024
    assert _peak_cpu_bytes(naive, tmp_path / "naive.json") > 1.5 * n * vocab * 4  # it can fail


# --- the request spec and result size --------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"outputs": {"logps", "logits"}}, "unknown"),
        ({"outputs": set()}, "unknown or no outputs"),
        ({"outputs": {"topk"}, "topk": 0}, r"topk k must be an integer in 1\.\.256"),
        ({"outputs": {"topk"}, "topk": 257}, r"1\.\.256, got 257"),
        ({"outputs": {"topk"}, "topk": 2.0}, "topk k"),
        ({"outputs": {"logps"}, "topk": 3}, "'topk' is not a requested output"),
        ({"outputs": {"gather"}}, "exactly one of"),
        ({"outputs": {"gather"}, "gather_ids": (1,), "gather_width": 1}, "exactly one of"),
        ({"outputs": {"gather"}, "gather_ids": (1, -2)}, "gather_ids entries"),
        ({"outputs": {"gather"}, "gather_ids": "abc"}, "list of token ids"),
        ({"outputs": {"gather"}, "gather_width": 4097}, r"gather_width must be .* 1\.\.4096"),
        ({"outputs": {"gather"}, "gather_ids": tuple(range(4097))}, "number of gather_ids"),
        ({"outputs": {"logps"}, "gather_ids": (1,)}, "'gather' is not a requested output"),
        ({"outputs": {"processed_logps"}}, "give both or neither"),
        ({"outputs": {"logps"}, "sampling": Sampling(top_k=3)}, "give both or neither"),
        ({"outputs": {"logps"}, "temperature": 0.0}, "temperature"),
        ({"outputs": {"logps"}, "temperature": math.nan}, "temperature"),
    ],
)
def test_bad_requests_are_rejected_with_the_reason(kwargs: dict, match: str) -> None:
    with pytest.raises(BadRequest, match=match) as info:
        TokenOutputs(**kwargs)
    assert info.value.code == "bad_request"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p must be a finite number"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"min_p": 2}, "min_p"),
    ],
)
def test_bad_sampling_values_are_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(BadRequest, match=match):
        Sampling(**kwargs)


def test_spec_normalises_its_fields() -> None:
    spec = TokenOutputs(["topk", "processed_logps"], topk=5, sampling={"top_k": None, "top_p": 1})
    assert spec.outputs == frozenset({"topk", "processed_logps"})
    assert spec.sampling == Sampling(top_k=0, top_p=1.0, min_p=0.0)
    assert TokenOutputs("logps").outputs == frozenset({"logps"})
    assert hash(spec) == hash(
        TokenOutputs({"topk", "processed_logps"}, topk=5, sampling=Sampling())
    )


def test_vocab_dependent_checks_at_compute_time() -> None:
    head = _head(vocab=100)
    hidden, labels = _inputs(4, vocab=100)
    cases = [
        (TokenOutputs({"topk"}, topk=101), None, "exceeds the model's vocabulary of 100"),
        (TokenOutputs({"gather"}, gather_ids=(3, 100)), None, r"\[100\] are outside"),
        (TokenOutputs({"gather"}, gather_width=2), None, "needs per-position gather ids"),
        (TokenOutputs({"gather"}, gather_width=2), torch.zeros(4, 3, dtype=torch.long), "shape"),
        (TokenOutputs({"gather"}, gather_width=2), torch.zeros(3, 2, dtype=torch.long), "shape"),
        (TokenOutputs({"gather"}, gather_width=2), torch.full((4, 2), 100), r"0\.\.99"),
        (TokenOutputs({"gather"}, gather_width=2), torch.full((4, 2), -1), r"0\.\.99"),
        (TokenOutputs({"gather"}, gather_width=2), torch.zeros(4, 2), "integers"),
        (TokenOutputs({"logps"}), torch.zeros(4, 2, dtype=torch.long), "no gather_width"),
    ]
    for spec, ids, match in cases:
        with pytest.raises(BadRequest, match=match):
            chunked_token_outputs(hidden, head, labels, spec, gather_ids=ids)
    with pytest.raises(ValueError, match="rows"):
        chunked_token_outputs(hidden, head, labels[:3], TokenOutputs({"logps"}))


@pytest.mark.parametrize("half", [False, True])
def test_result_bytes_is_known_before_compute(half: bool) -> None:
    spec = TokenOutputs(ALL, topk=20, gather_ids=(1, 2, 3), sampling=Sampling(min_p=0.1))
    per = 4 * 3 + 20 * (6 if half else 8) + 4 + 3 * (2 if half else 4)
    assert result_bytes(1000, spec, half=half) == 1000 * per
    hidden, labels = _inputs(7)
    with torch.inference_mode():
        got = chunked_token_outputs(hidden, _head(), labels, spec)
    if half:
        got = {k: v.half() if k in ("topk_logps", "gather_logps") else v for k, v in got.items()}
    assert result_bytes(7, spec, half=half) == sum(v.nbytes for v in got.values())
    assert result_bytes(7, TokenOutputs({"gather"}, gather_width=5), half=half) == 7 * 5 * (
        2 if half else 4
    )
