"""Teacher outputs through the executor equal a float64 naive reference on tiny models.

The reference is the model's own logits (softcap/scale included) in float64, ``/ T``,
``log_softmax`` over the full vocabulary, then ``topk`` / gather / entropy / the renormalised
sampler support, read at each scored position. Packed and padded batches, T != 1, a
Gemma2-style ``final_logit_softcapping`` model, prompt_len and multi-segment masks, ``both``
mode, k = 1 and k = 96 (the whole tiny vocabulary) and k = 256 on a larger one, shared and
per-position gather ids; each through whole-vocabulary blocks and through vocabulary tiles
(``head_vocab_tile``, the CPU default), whose running top-k, tail and entropy must agree too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.models import random_model, random_tokens, tiny_causal
from worker.errors import BadRequest
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.executor.rewards.pooling import ValueHeadAdapter
from worker.scorer import ScoreOptions
from worker.scorer.teacher import Sampling, TokenOutputs

ATOL = 1e-4
ALL = ("logps", "entropy", "topk", "gather", "processed_logps")


def tiny_gemma2(vocab: int = 96, seed: int = 0) -> torch.nn.Module:
    """A tiny Gemma2 (``final_logit_softcapping`` 5.0: a softcap that bites on these logits)."""
    from transformers import Gemma2Config

    cfg = Gemma2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        final_logit_softcapping=5.0, initializer_range=0.5, attn_implementation="eager",
    )  # fmt: skip
    return random_model("Gemma2ForCausalLM", cfg, seed)


def naive(model: torch.nn.Module, tokens: list[int], scored: np.ndarray, t: float) -> torch.Tensor:
    """float64 ``log_softmax(logits / T)`` at the positions predicting ``scored`` ``[n, V]``."""
    ids = torch.tensor(tokens)[None]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].double()  # [L, V]
    return torch.log_softmax(logits / t, dim=-1)[torch.from_numpy(scored) - 1]  # [n, V]


def naive_processed(lp: torch.Tensor, labels: torch.Tensor, s: Sampling) -> np.ndarray:
    """The sampled token's log-prob renormalised over the top-k -> top-p -> min-p support."""
    p = lp.exp()  # [n, V]
    keep = torch.ones_like(p, dtype=torch.bool)
    if s.top_k_for(p.shape[1]):
        keep &= p >= p.topk(s.top_k_for(p.shape[1]), dim=1).values[:, -1:]
    if s.top_p < 1.0:
        q = torch.where(keep, p, 0.0)
        q = q / q.sum(1, keepdim=True)
        desc = q.sort(dim=1, descending=True).values
        before = desc.cumsum(1) - desc
        kept = (before < s.top_p) & (desc > 0)
        thr = torch.where(kept, desc, torch.inf).amin(dim=1, keepdim=True)
        keep &= q >= thr
    if s.min_p > 0:
        keep &= p >= s.min_p * p.amax(dim=1, keepdim=True)
    masked = torch.log_softmax(lp.masked_fill(~keep, -torch.inf), dim=1)
    return masked.gather(1, labels[:, None]).squeeze(1).numpy()


def check(got, lp: torch.Tensor, labels: torch.Tensor, spec: TokenOutputs, ids=None) -> None:
    """Every array of ``got`` (a ``SequenceScore``) against the naive ``lp`` ``[n, V]``."""
    a = got.arrays or {}
    want = set()
    if "logps" in spec.outputs:
        assert got.logps.dtype == np.float32
        np.testing.assert_allclose(got.logps, lp.gather(1, labels[:, None])[:, 0], atol=ATOL)
    else:
        assert got.logps is None
    if "entropy" in spec.outputs:
        want.add("entropy")
        np.testing.assert_allclose(a["entropy"], -(lp.exp() * lp).sum(1), atol=ATOL)
    if "topk" in spec.outputs:
        want |= {"topk_ids", "topk_logps", "topk_tail_logp"}
        top = lp.topk(spec.topk, dim=1)
        assert a["topk_ids"].dtype == np.int32 and a["topk_ids"].shape == (len(lp), spec.topk)
        np.testing.assert_allclose(a["topk_logps"], top.values, atol=ATOL)
        # ids where values are not tied (a gap of more than the tolerance to both neighbours)
        vals = top.values.numpy()
        gaps = np.diff(vals, axis=1)
        clear = np.ones_like(vals, dtype=bool)
        clear[:, 1:] &= np.abs(gaps) > 1e-3
        clear[:, :-1] &= np.abs(gaps) > 1e-3
        assert (a["topk_ids"][clear] == top.indices.numpy()[clear]).all()
        tail = torch.log1p(-top.values.exp().sum(1).clamp(max=1.0))
        if spec.topk < lp.shape[1]:
            np.testing.assert_allclose(a["topk_tail_logp"], tail, atol=ATOL)
    if "gather" in spec.outputs:
        want.add("gather_logps")
        idx = torch.as_tensor(ids) if ids is not None else torch.tensor(spec.gather_ids)
        idx = idx if idx.dim() == 2 else idx.expand(len(lp), -1)
        np.testing.assert_allclose(a["gather_logps"], lp.gather(1, idx.long()), atol=ATOL)
    if "processed_logps" in spec.outputs:
        want.add("processed_logps")
        ref = naive_processed(lp, labels, spec.sampling)
        assert (np.isinf(a["processed_logps"]) == np.isinf(ref)).all()
        fin = np.isfinite(ref)
        np.testing.assert_allclose(a["processed_logps"][fin], ref[fin], atol=ATOL)
    assert set(a) == want
    for value in a.values():
        assert value.dtype in (np.float32, np.int32) and len(value) == len(lp)


def _inputs(vocab: int, k: int, seed: int = 0):
    """Sequences with prompt_len and multi-segment masks, and per-position gather ids."""
    seqs, scored = [], []
    rng = np.random.default_rng(seed)
    for i, n in enumerate((12, 30, 5, 19, 2, 17)):
        tokens = random_tokens(n, seed + i, vocab=vocab)
        if i % 2:  # several scored segments with gaps
            mask = (rng.random(n) < 0.5).astype(np.uint8)
            mask[0], mask[-1] = 0, 1
            pos = np.flatnonzero(mask)
            kw = {"mask": mask.tobytes()}
        else:
            p = max(1, n // 3)
            pos = np.arange(p, n)
            kw = {"prompt_len": p}
        ids = rng.integers(0, vocab, size=(len(pos), k), dtype=np.int32)
        seqs.append(SequenceInput(tokens, gather_ids=ids, **kw))
        scored.append(pos)
    return seqs, scored


#: ``head_vocab_tile`` values: the CPU default (tiles of 1,024: one tile on these vocabularies),
#: whole-vocabulary blocks (the accelerator default), and tiles of 5 (a ragged last tile).
TILES = [None, 0, 5]


@pytest.mark.parametrize("packing", ["packed", "unmasked", "padded"])
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("sampler", [True, False], ids=["sampler", "tiles5"])
def test_all_outputs_match_naive_float64(
    packing: str, arch: str, temperature: float, sampler: bool
) -> None:
    model = tiny_gemma2() if arch == "gemma2" else tiny_causal("llama")
    config = ExecutorConfig(
        packing=packing,  # type: ignore[arg-type]
        logprob_chunk_tokens=7,
        attention_backend="eager",
        bucket_pad_fraction=1.0,  # unmasked: one bucket, its rows right-padded
        head_vocab_tile=5,  # a sampler's support takes whole-vocabulary blocks anyway
    )
    ex = StatelessExecutor(config, model)
    assert ex.packed == (packing == "packed") and ex.layout == packing
    seqs, scored = _inputs(96, k=5)
    if sampler:
        sampling = Sampling(top_k=20, top_p=0.9, min_p=0.01)
        spec = TokenOutputs(ALL, topk=8, gather_width=5, sampling=sampling)
    else:  # every output but the sampler's, through vocabulary tiles of 5
        spec = TokenOutputs(ALL[:-1], topk=8, gather_width=5)
    out = ex.score(seqs, temperature=temperature, options=ScoreOptions(outputs=spec))
    for s, pos, got in zip(seqs, scored, out.scores, strict=True):
        lp = naive(model, s.tokens, pos, temperature)
        labels = torch.tensor(s.tokens)[pos]
        check(got, lp, labels, spec, s.gather_ids)


@pytest.mark.parametrize(
    "spec",
    [
        TokenOutputs(("topk",), topk=1),
        TokenOutputs(("entropy", "topk"), topk=96),  # the whole vocabulary: no tail
        TokenOutputs(("logps", "gather"), gather_ids=(0, 5, 95)),
        TokenOutputs(("processed_logps",), sampling=Sampling(top_k=3)),
        TokenOutputs(("processed_logps", "logps"), sampling=Sampling(min_p=0.2)),
    ],
)
@pytest.mark.parametrize("tile", TILES)
def test_each_output_alone(spec: TokenOutputs, tile: int | None) -> None:
    model = tiny_causal("qwen2")
    ex = StatelessExecutor(ExecutorConfig(head_vocab_tile=tile), model)
    seqs, scored = _inputs(96, k=1, seed=3)
    seqs = [SequenceInput(s.tokens, prompt_len=s.prompt_len, mask=s.mask) for s in seqs]
    out = ex.score(seqs, options=ScoreOptions(outputs=spec))
    for s, pos, got in zip(seqs, scored, out.scores, strict=True):
        check(got, naive(model, s.tokens, pos, 1.0), torch.tensor(s.tokens)[pos], spec)


@pytest.mark.parametrize("tile", [0, 100])
def test_k_256_on_a_larger_vocabulary_with_small_byte_chunks(tile: int) -> None:
    from tests.support.models import tiny_model

    torch.manual_seed(0)
    model = tiny_model("ForCausalLM", "llama", 0, vocab=512)
    # blocks: 32 rows of [512] x 1; tiles of 100 ids (k = 256 spans several): 163 rows
    config = ExecutorConfig(logprob_chunk_bytes=64 * 1024, head_vocab_tile=tile)
    ex = StatelessExecutor(config, model)
    seqs, scored = _inputs(512, k=3, seed=7)
    spec = TokenOutputs(("logps", "topk", "entropy"), topk=256)
    seqs = [SequenceInput(s.tokens, prompt_len=s.prompt_len, mask=s.mask) for s in seqs]
    out = ex.score(seqs, options=ScoreOptions(outputs=spec))
    for s, pos, got in zip(seqs, scored, out.scores, strict=True):
        check(got, naive(model, s.tokens, pos, 1.0), torch.tensor(s.tokens)[pos], spec)


def _value_head() -> ValueHeadAdapter:
    torch.manual_seed(4)
    return ValueHeadAdapter(torch.nn.Linear(32, 1))


@pytest.mark.parametrize("tile", TILES)
def test_both_mode_one_model_two_surfaces(tile: int | None) -> None:
    model = tiny_causal("llama")
    config = ExecutorConfig(mode="both", head_vocab_tile=tile)
    ex = StatelessExecutor(config, model, reward_adapter=_value_head())
    seqs, scored = _inputs(96, k=4, seed=11)
    spec = TokenOutputs(("logps", "entropy", "topk", "gather"), topk=4, gather_width=4)
    bare = [SequenceInput(s.tokens, prompt_len=s.prompt_len, mask=s.mask) for s in seqs]
    plain = ex.score(bare, mode="both")
    out = ex.score(seqs, mode="both", temperature=1.3, options=ScoreOptions(outputs=spec))
    for s, pos, got, old in zip(seqs, scored, out.scores, plain.scores, strict=True):
        assert got.reward == pytest.approx(old.reward, abs=1e-5)
        check(
            got, naive(model, s.tokens, pos, 1.3), torch.tensor(s.tokens)[pos], spec, s.gather_ids
        )


def test_plain_logps_unchanged_and_chunking_by_bytes_agrees() -> None:
    model = tiny_causal("mistral")
    seqs, _ = _inputs(96, k=1, seed=2)
    seqs = [SequenceInput(s.tokens, prompt_len=s.prompt_len, mask=s.mask) for s in seqs]
    one_row = StatelessExecutor(ExecutorConfig(logprob_chunk_bytes=1), model).score(seqs)
    big = StatelessExecutor(ExecutorConfig(), model).score(seqs)
    explicit = StatelessExecutor(ExecutorConfig(), model).score(
        seqs, options=ScoreOptions(outputs=TokenOutputs(("logps",)))
    )
    for a, b, c in zip(one_row.scores, big.scores, explicit.scores, strict=True):
        np.testing.assert_allclose(a.logps, b.logps, atol=1e-6)
        assert a.arrays is None and c.arrays is None
        assert np.array_equal(b.logps, c.logps)


@pytest.mark.parametrize(
    ("spec", "gather", "mode", "match"),
    [
        (TokenOutputs(("topk",), topk=200), None, "reference", "exceeds the model's vocabulary"),
        (TokenOutputs(("gather",), gather_ids=(1, 96)), None, "reference", r"\[96\] are outside"),
        (TokenOutputs(("gather",), gather_width=2), None, "reference", r"needs gather_ids"),
        (
            TokenOutputs(("gather",), gather_width=2),
            np.zeros((3, 3), np.int32),
            "reference",
            r"shape \[3, 3\], expected \[\d+, 2\]",
        ),
        (TokenOutputs(("gather",), gather_width=2), "full", "reference", "outside the vocabulary"),
        (TokenOutputs(("entropy",)), None, "reward", "need mode reference or both"),
        (TokenOutputs(("logps",)), np.zeros((3, 1), np.int32), "reference", "no 'gather'"),
    ],
)
def test_bad_requests_name_the_sequence_and_reason(spec, gather, mode, match) -> None:
    ex = StatelessExecutor(
        ExecutorConfig(mode="both"), tiny_causal("llama"), reward_adapter=_value_head()
    )
    tokens = random_tokens(8, 0)
    if isinstance(gather, str):
        gather = np.full((5, 2), 96, np.int32)
    seqs = [SequenceInput(tokens, prompt_len=3, gather_ids=gather)]
    options = ScoreOptions(outputs=spec)
    with pytest.raises(BadRequest, match=match):
        ex.validate(seqs, mode, None, options)
    with pytest.raises(BadRequest, match=match):
        ex.score(seqs, mode=mode, options=options)
