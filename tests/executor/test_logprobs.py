"""The chunked log-prob fast path agrees with the naive float64 log_softmax + gather."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from worker.executor.head.logprobs import (
    LogitTransform,
    chunked_token_logps,
    logit_transform_for,
    naive_token_logps,
)


def _head(hidden: int = 16, vocab: int = 50, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    head = nn.Linear(hidden, vocab, bias=bias)
    nn.init.normal_(head.weight, std=1.0)
    return head


def _naive64(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, t: float) -> torch.Tensor:
    logits = head(hidden).double()  # [N, V]
    return torch.log_softmax(logits / t, dim=-1).gather(-1, labels[:, None])[:, 0]


@pytest.mark.parametrize("chunk", [1, 3, 7, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_matches_naive_float64(chunk: int, temperature: float, bias: bool) -> None:
    head = _head(bias=bias)
    hidden = torch.randn(23, 16, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 50, (23,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got = chunked_token_logps(hidden, head, labels, temperature=temperature, chunk_tokens=chunk)
        want = _naive64(hidden, head, labels, temperature)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=0)


def test_naive_helper_is_log_softmax_gather() -> None:
    logits = torch.randn(4, 5, 11)
    labels = torch.randint(0, 11, (4, 5))
    want = torch.log_softmax(logits.double() / 0.5, -1).gather(-1, labels[..., None])[..., 0]
    assert torch.allclose(naive_token_logps(logits, labels, 0.5).double(), want, atol=1e-6)


def test_half_precision_head_reduces_in_float32() -> None:
    head = _head().to(torch.bfloat16)
    hidden = torch.randn(9, 16).to(torch.bfloat16)
    labels = torch.randint(0, 50, (9,))
    with torch.inference_mode():
        got = chunked_token_logps(hidden, head, labels, chunk_tokens=4)
        want = naive_token_logps(head(hidden), labels)
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize(
    "transform",
    [LogitTransform(softcap=3.0), LogitTransform(scale=0.5), LogitTransform(divisor=4.0)],
)
def test_logit_transforms_match_their_naive_formula(transform: LogitTransform) -> None:
    head = _head()
    hidden = torch.randn(8, 16)
    labels = torch.randint(0, 50, (8,))
    with torch.inference_mode():
        logits = head(hidden).double()
        if transform.scale:
            logits = logits * transform.scale
        if transform.divisor:
            logits = logits / transform.divisor
        if transform.softcap:
            logits = transform.softcap * torch.tanh(logits / transform.softcap)
        want = torch.log_softmax(logits / 0.9, -1).gather(-1, labels[:, None])[:, 0]
        got = chunked_token_logps(
            hidden, head, labels, temperature=0.9, chunk_tokens=3, transform=transform
        )
    assert torch.allclose(got.double(), want, atol=1e-5)


def test_transform_read_from_config() -> None:
    class Cfg:
        final_logit_softcapping = 30.0
        logit_scale = 1.0
        logits_scaling = 8

    class M(nn.Module):
        config = Cfg()

    t = logit_transform_for(M())
    assert t == LogitTransform(scale=None, divisor=8.0, softcap=30.0)
    assert logit_transform_for(nn.Linear(2, 2)).identity


def test_rejects_bad_arguments() -> None:
    head = _head()
    with pytest.raises(ValueError, match="rows"):
        chunked_token_logps(torch.randn(3, 16), head, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_logps(
            torch.randn(3, 16), head, torch.zeros(3, dtype=torch.long), temperature=0.0
        )
