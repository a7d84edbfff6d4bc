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

SGLang (``python/sglang/srt/managers/io_struct.py``; ``meta_info.input_token_logprobs``):
``[logprob, token_id, None]`` per input position from ``logprob_start_len``, the logprob of
position 0 being ``None``; with ``top_logprobs_num`` k, ``input_top_logprobs`` holds per position
a list of k ``[logprob, token_id, None]`` (``None`` at position 0).
"""

from __future__ import annotations

from typing import Any

from worker.client.results import SeqScore


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
