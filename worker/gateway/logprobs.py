"""Prompt log-probs as vLLM and SGLang write them, from one scored sequence.

The job behind them scores every position from ``start`` on (``prompt_len = start``) with the
outputs ``logps`` and ``rank`` (and ``topk`` with k > 0), at the request's temperature.

vLLM (``vllm/v1/engine/logprobs.py``, ``_make_logprob_dict``; the rank from
``vllm/v1/sample/ops/logprobs.py``, ``batched_count_greater_than``): position 0 is ``None``;
every later position ``p`` is a dict keyed by ``str(token id)``, the actual token ``ids[p]``
first with ``{"logprob", "rank", "decoded_token"}`` (``rank``: how many tokens are at least as
likely, 1-based, exact even outside the top k), then the top k in order with ranks 1..k. The
actual token inside the top k appears once, at the front, with its top-k rank (vLLM writes it
twice into the same key). prime-rl reads the first value of each dict as the actual token's
log-prob, TRL sorts by ``rank``: both hold. ``decoded_token`` is ``None``: the gateway has no
tokenizer (neither client reads it).

vLLM's log-probs at chosen ids (``docs/training/prompt_token_id_logprobs.md``):
``prompt_logprob_token_ids`` is one candidate list shared by every scored row, or one list per
row (exactly ``len - 1 - prompt_logprob_start`` rows, shorter rows padded with -1); the answer
``prompt_token_id_logprobs`` is a base64 ``.npy`` float32 ``[rows, K]`` whose row ``i`` scores
token ``prompt_logprob_start + i + 1`` at the row's ids in order, ``-inf`` where the id is -1.
The job gathers them (``gather`` output, per-position ids; -1 sent as id 0).

SGLang (``python/sglang/srt/managers/io_struct.py``; ``meta_info.input_token_logprobs``):
``[logprob, token_id, None]`` per input position from ``logprob_start_len``, the logprob of
position 0 being ``None``; with ``top_logprobs_num`` k, ``input_top_logprobs`` holds per position
a list of k ``[logprob, token_id, None]`` (``None`` at position 0).
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from worker.client.results import SeqScore
from worker.gateway.errors import GatewayError


def _rows(score: SeqScore, k: int) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    logps = score.logps.tolist() if score.logps is not None else []
    ranks = score.rank.tolist() if score.rank is not None else [None] * len(logps)
    n = len(logps)
    if k and score.topk_ids is not None and score.topk_logps is not None:  # [n, k] ([n] at k=1)
        ids = score.topk_ids.reshape(n, -1).tolist()
        lps = score.topk_logps.astype("float32").reshape(n, -1).tolist()
    else:
        ids = lps = [[]] * n
    return logps, ranks, ids, lps


def vllm_prompt_logprobs(tokens: list[int], score: SeqScore, k: int) -> list[Any]:
    """vLLM's ``prompt_logprobs`` for ``tokens`` (scored from position 1) with top ``k``."""
    logps, ranks, top_ids, top_lps = _rows(score, k)
    out: list[Any] = [None]
    for p in range(1, len(tokens)):
        actual = tokens[p]
        row: dict[str, Any] = {
            str(actual): {"logprob": logps[p - 1], "rank": ranks[p - 1], "decoded_token": None}
        }
        for j, (tid, lp) in enumerate(zip(top_ids[p - 1], top_lps[p - 1], strict=True)):
            row[str(tid)] = {"logprob": lp, "rank": j + 1, "decoded_token": None}
        out.append(row)
    return out


def sglang_input_logprobs(
    tokens: list[int], score: SeqScore, start: int, k: int
) -> tuple[list[list[Any]], list[Any] | None]:
    """SGLang's ``input_token_logprobs`` (and ``input_top_logprobs`` when ``k``) for ``tokens``
    from position ``start``; ``score`` scored positions ``max(start, 1)`` on."""
    logps, _, top_ids, top_lps = _rows(score, k)
    first = max(start, 1)
    tok: list[list[Any]] = [[None, tokens[0], None]] if start == 0 else []
    tops: list[Any] = [None] if start == 0 else []
    for p in range(first, len(tokens)):
        i = p - first
        tok.append([logps[i], tokens[p], None])
        if k:
            tops.append([[lp, tid, None] for tid, lp in zip(top_ids[i], top_lps[i], strict=True)])
    return tok, (tops if k else None)


@dataclass(frozen=True)
class ChosenIds:
    """``prompt_logprob_token_ids`` of one prompt: ``ids`` ``[rows, K]`` (-1: none), row ``i``
    scoring token ``start + i + 1``."""

    ids: np.ndarray  # [rows, K] int64
    start: int

    @classmethod
    def of(cls, length: int, given: list[Any], start: int | None) -> ChosenIds:
        """The ids of a prompt of ``length`` tokens (400 when they do not fit it)."""
        start = 0 if start is None else start
        if start < 0:
            raise GatewayError("bad_request", f"prompt_logprob_start must be >= 0, got {start}")
        rows = max(length - 1 - start, 0)
        if given and isinstance(given[0], list):
            if len(given) != rows:
                raise GatewayError(
                    "bad_request",
                    f"prompt_logprob_token_ids has {len(given)} rows: the prompt of {length} "
                    f"tokens from prompt_logprob_start {start} scores {rows}",
                )
            k = max((len(row) for row in given), default=0)
            ids = np.full((rows, k), -1, dtype=np.int64)
            for i, row in enumerate(given):
                ids[i, : len(row)] = row
        else:
            ids = np.tile(np.asarray(given, dtype=np.int64), (rows, 1)).reshape(rows, len(given))
        if ids.shape[1] == 0 and rows:
            raise GatewayError("bad_request", "prompt_logprob_token_ids names no id")
        return cls(ids, start)

    @property
    def width(self) -> int:
        """K."""
        return int(self.ids.shape[1])

    def gather_ids(self, first: int, length: int) -> np.ndarray:
        """The gather ids ``[length - first, K]`` int32 of a job scoring positions ``first..``
        (positions before ``start + 1`` and -1 cells read id 0, dropped from the answer)."""
        out = np.zeros((length - first, self.width), dtype=np.int32)
        lo = self.start + 1 - first  # the row of position start + 1 in the job
        out[lo:] = np.maximum(self.ids, 0)
        return out

    def answer(self, score: SeqScore | None, first: int) -> str:
        """``prompt_token_id_logprobs``: the base64 ``.npy`` of ``[rows, K]`` float32."""
        rows, k = self.ids.shape
        matrix = np.full((rows, k), -np.inf, dtype=np.float32)
        if rows and k and score is not None and score.gather_logps is not None:
            gathered = np.asarray(score.gather_logps, dtype=np.float32).reshape(-1, k)
            matrix[:] = gathered[self.start + 1 - first :]
            matrix[self.ids < 0] = -np.inf
        buffer = io.BytesIO()
        np.save(buffer, matrix, allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode()
