"""One Tinker ``SampleRequest`` as one scored sequence, and its ``SampleResponse`` arrays from
the sequence's score.

What a request may ask (``tinker/lib/public_interfaces/sampling_client.py``, ``sample`` and
``compute_logprobs``), and what it gets:

* ``prompt_logprobs``: float32 ``[len(prompt)]``, position ``p`` = ``log p(prompt[p] |
  prompt[:p])``, NaN at position 0 and wherever unscored.
* ``topk_prompt_logprobs`` k: ``[len(prompt), k]`` ids (int32) and log-probs (float32), the k
  most likely tokens at each position in descending order, rows without a score padded with id 0
  / -99999 (what ``tinker/types/topk_logprobs.py`` reads as "no entry"). k is bounded by the
  workers' ``--max-topk`` (a larger k is the workers' ``bad_request``).
* ``prompt_logprobs_last_n`` N: only the last N positions of both (the rest NaN / padding).
* ``target_prompt_logprobs``: int64 ids ``[len(prompt) - 1, K]`` (row ``i`` is position
  ``i + 1``; ``-1`` asks nothing), dense or sparse CSR; answered float32 in the same shape and
  layout, 0.0 where the ids had -1. Rows before the first that names an id are not scored.

The log-probs are the raw logits' (temperature 1): nothing is sampled, and the sampler's
temperature, top-k and top-p do not apply to prompt log-probs (vLLM's rule). Generation is not
served: ``max_tokens`` must be 1 (or 0), the answer's ``num_samples`` sequences carry no tokens
(tinker-cookbook's distillation reads only the prompt arrays of such a call), and
``topk_sample_logprobs`` and ``prompt_alt_tokens_k`` (drawing tokens) are refused as the user's
error (``GatewayError("bad_request")``).

Image chunks (``worker.gateway.tinker.images``): the job carries their files and the sequence
names them; image-token positions are never scored, so every array is NaN / padding / 0.0 at
them (and at the position after a run, predicted from an image token, as at any other).

One job scores the prompt from ``start`` on (the job's ``prompt_len``): the first position any
of the asked arrays needs, with outputs ``logps`` (+ ``topk``, + ``gather`` with per-position
ids, -1 sent as id 0 and answered 0.0).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from worker.client.coalesce import BatchKey
from worker.client.results import SeqScore
from worker.gateway.errors import GatewayError
from worker.gateway.tinker.images import PromptInput, prompt_input
from worker.gateway.tinker.wire import (
    TOPK_PAD_ID,
    TOPK_PAD_LOGPROB,
    SampleAnswer,
    SampleRequest,
    TensorData,
    csr_rows,
)

#: ``num_samples`` above this is refused (each is an empty sequence; a bound on the answer).
MAX_SAMPLES = 1024


def _user(message: str) -> GatewayError:
    return GatewayError("bad_request", message)


@dataclass(frozen=True)
class TargetIds:
    """``target_prompt_logprobs`` as asked: dense ``ids`` ``[L - 1, K]`` (-1: nothing), and
    the CSR indices when it came sparse (the answer keeps the layout)."""

    ids: np.ndarray  # [L - 1, K] int64
    csr: tuple[list[int], list[int]] | None

    @property
    def first_row(self) -> int | None:
        """The first row that names an id (None: none does)."""
        named = np.flatnonzero((self.ids >= 0).any(axis=1))
        return int(named[0]) if named.size else None


def decode_target(td: TensorData, length: int) -> TargetIds:
    """The ids of a ``TensorData`` for a prompt of ``length`` tokens (checked)."""
    if td.dtype != "int64":
        raise _user(f"target_prompt_logprobs must be int64 token ids, got {td.dtype}")
    shape = td.shape
    if shape is None or len(shape) != 2 or shape[0] != length - 1 or shape[1] < 1:
        raise _user(
            f"target_prompt_logprobs must have shape [len(prompt) - 1, K] = "
            f"[{length - 1}, K >= 1], got {shape}"
        )
    rows, k = shape
    data = np.asarray(td.data, dtype=np.int64)
    csr = None
    if td.sparse_crow_indices is not None or td.sparse_col_indices is not None:
        crow, col = td.sparse_crow_indices or [], td.sparse_col_indices or []
        ok = (
            len(crow) == rows + 1
            and crow[0] == 0
            and crow[-1] == len(col) == data.size
            and all(a <= b for a, b in itertools.pairwise(crow))
            and all(0 <= c < k for c in col)
        )
        if not ok:
            raise _user("target_prompt_logprobs: inconsistent CSR indices")
        ids = np.full((rows, k), -1, dtype=np.int64)
        ids[csr_rows(crow), np.asarray(col, dtype=np.int64)] = data
        csr = (list(crow), list(col))
    else:
        if data.size != rows * k:
            raise _user(f"target_prompt_logprobs has {data.size} ids for shape {shape}")
        ids = data.reshape(rows, k)
    if (ids < -1).any() or (ids >= 2**31).any():
        raise _user("target_prompt_logprobs ids must be token ids >= 0, or -1 for none")
    target = TargetIds(ids, csr)
    if target.first_row is None:
        raise _user("target_prompt_logprobs names no id (every cell is -1)")
    return target


@dataclass(frozen=True)
class SamplePlan:
    """What one request scores (see the module docstring). ``start`` is the job's
    ``prompt_len`` (0: nothing to score, no job)."""

    tokens: list[int]
    num_samples: int
    logprobs: bool
    topk: int
    first: int  # the first position prompt_logprobs / topk report (prompt_logprobs_last_n)
    target: TargetIds | None
    start: int
    images: tuple[bytes, ...] = ()
    image_token: int | None = None

    @classmethod
    def of(cls, request: SampleRequest, image_token: int | None = None) -> SamplePlan:
        """The plan of ``request`` (``image_token``: the served model's, for image chunks);
        ``GatewayError("bad_request")`` for what is not served."""
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None or max_tokens > 1:
            raise _user(
                f"max_tokens={max_tokens}: this fleet scores prompts and generates nothing; "
                "send max_tokens=1 (compute_logprobs does) for prompt log-probs, top-k and "
                "target_prompt_logprobs"
            )
        if request.topk_sample_logprobs or request.prompt_alt_tokens_k:
            raise _user(
                "topk_sample_logprobs and prompt_alt_tokens_k need sampling: not served "
                "(ask topk_prompt_logprobs instead)"
            )
        if not 1 <= request.num_samples <= MAX_SAMPLES:
            raise _user(f"num_samples must be 1..{MAX_SAMPLES}, got {request.num_samples}")
        if request.topk_prompt_logprobs < 0:
            raise _user(f"topk_prompt_logprobs must be >= 0, got {request.topk_prompt_logprobs}")
        prompt: PromptInput = prompt_input(request.prompt.chunks, image_token)
        tokens = prompt.tokens
        n = len(tokens)
        if n < 1:
            raise _user("the prompt is empty")
        logprobs, k = bool(request.prompt_logprobs), request.topk_prompt_logprobs
        last_n = request.prompt_logprobs_last_n
        first = 1
        if last_n is not None:
            if not logprobs or not 1 <= last_n <= n - 1:
                raise _user(
                    f"prompt_logprobs_last_n={last_n}: needs prompt_logprobs and 1 <= N <= "
                    f"len(prompt) - 1 = {n - 1}"
                )
            first = n - last_n
        target = None
        if request.target_prompt_logprobs is not None:
            if n < 2:
                raise _user("target_prompt_logprobs needs a prompt of at least 2 tokens")
            target = decode_target(request.target_prompt_logprobs, n)
        needs = [first] if (logprobs or k) and n >= 2 else []
        if target is not None:
            needs.append((target.first_row or 0) + 1)
        start = min(needs, default=0)
        return cls(
            tokens, request.num_samples, logprobs, k, first, target, start,
            prompt.images, prompt.image_token,
        )  # fmt: skip

    def seq(self) -> dict[str, Any]:
        """The sequence map of the job (``ScoringClient.score``'s form)."""
        seq: dict[str, Any] = {"tokens": self.tokens, "prompt_len": self.start}
        if self.images:
            seq["images"] = list(range(len(self.images)))
        if self.target is not None:
            rows = self.target.ids[self.start - 1 :]  # [n_scored, K]: position start.. on
            seq["gather_ids"] = np.where(rows < 0, 0, rows).astype(np.int32)
        return seq

    def key(self, adapter: str | None, version: str | None) -> BatchKey:
        """The job settings (requests with equal keys share jobs)."""
        outputs = ("logps",) + (("topk",) if self.topk else ())
        outputs += ("gather",) if self.target is not None else ()
        return BatchKey(
            mode="reference",
            temperature=1.0,
            outputs=outputs,
            topk=self.topk or None,
            adapter=adapter,
            version=version,
            gather_width=self.target.ids.shape[1] if self.target is not None else None,
        )

    def scored(self) -> np.ndarray:
        """The positions the job's outputs cover: ``start .. n-1`` but image tokens."""
        at = np.arange(self.start, len(self.tokens)) if self.start else np.arange(0)
        if self.image_token is not None:
            at = at[np.asarray(self.tokens)[at] != self.image_token]
        return at

    def answer(self, score: SeqScore | None) -> SampleAnswer:
        """The response arrays from the job's score (None: there was no job)."""
        n = len(self.tokens)
        at = self.scored()  # [scored]
        scored = len(at)
        lp = top_ids = top_lps = target = None
        if self.logprobs:
            lp = np.full(n, np.nan, dtype=np.float32)
            if scored and score is not None and score.logps is not None:
                lp[at] = np.asarray(score.logps, dtype=np.float32)
            lp[: self.first] = np.nan  # position 0, and before prompt_logprobs_last_n
        if self.topk:
            k = self.topk
            top_ids = np.full((n, k), TOPK_PAD_ID, dtype=np.int32)
            top_lps = np.full((n, k), TOPK_PAD_LOGPROB, dtype=np.float32)
            if scored and score is not None and score.topk_ids is not None:
                top_ids[at] = np.asarray(score.topk_ids).reshape(scored, k)
                top_lps[at] = np.asarray(score.topk_logps, dtype=np.float32).reshape(scored, k)
            top_ids[: self.first] = TOPK_PAD_ID
            top_lps[: self.first] = TOPK_PAD_LOGPROB
        if self.target is not None:
            ids = self.target.ids
            target = np.zeros(ids.shape, dtype=np.float32)
            if score is not None and score.gather_logps is not None:
                gathered = np.asarray(score.gather_logps, dtype=np.float32)
                target[at - 1] = gathered.reshape(scored, ids.shape[1])
            target[ids < 0] = 0.0
        return SampleAnswer(
            num_sequences=self.num_samples,
            prompt_logprobs=lp,
            topk_ids=top_ids,
            topk_logprobs=top_lps,
            target=target,
            target_csr=self.target.csr if self.target is not None else None,
        )
