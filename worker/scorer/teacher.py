"""Teacher outputs on the scorer's side, torch-free: sizes, layouts and the checks that need the
model or the worker's limits.

What a job may ask for is ``worker.request.TokenOutputs`` (with its ``Sampling``), decoded by the
protocol and carried on ``ScoreOptions.outputs`` (its names are re-exported here). This module
adds what the scorers need of it: ``result_bytes`` sizes a result before any compute;
``array_layout`` names the dtype and width of every array a result carries
(``docs/protocol.md``); ``check_limits`` applies a worker's limits, ``check_call`` the model's,
``gather_rows`` checks one sequence's per-position ids. Every check raises ``BadRequest``.

Arrays per scored position (row ``i`` belongs to the ``i``-th scored token):

======================  ========================  ==========================================
output                  arrays                    dtype, width
======================  ========================  ==========================================
``logps``               ``logps``                 float32, 1 (today's result)
``entropy``             ``entropy``               float32, 1
``topk``                ``topk_ids``,             int32, k (log-probs descending)
                        ``topk_logps``,           float32 (float16 with ``float16``), k
                        ``topk_tail_logp``        float32, 1 (log of the mass outside the top k)
``gather``              ``gather_logps``          float32 (float16 with ``float16``), K
``processed_logps``     ``processed_logps``       float32, 1 (``-inf`` outside the support)
``rank``                ``rank``                  int32, 1 (1-based: how many tokens have a
                                                  log-prob >= the actual token's, as vLLM
                                                  ranks prompt tokens)
``hidden``              ``hidden``                ``hidden_dtype`` (``bf16`` bits, ``<f4`` or
                                                  ``<f2``), H: the vector the LM head reads
======================  ========================  ==========================================
"""

from __future__ import annotations

from typing import Any

import numpy as np

from worker.errors import BadRequest, TooLarge
from worker.modes import LOGPROB_MODES
from worker.request import (
    HIDDEN_WIRE_DTYPES,
    LOGPS_ONLY,
    MAX_GATHER_IDS,
    MAX_TOPK,
    OUTPUT_NAMES,
    SORT_FREE_TOP_K,
    Sampling,
    TokenOutputs,
)

__all__ = [
    "DEFAULT_MAX_RESULT_BYTES",
    "LOGPS_ONLY",
    "MAX_GATHER_IDS",
    "MAX_TOPK",
    "OUTPUT_NAMES",
    "SORT_FREE_TOP_K",
    "Sampling",
    "TokenOutputs",
    "array_layout",
    "check_call",
    "check_limits",
    "gather_rows",
    "result_bytes",
]

DEFAULT_MAX_RESULT_BYTES = 64 * 1024 * 1024
"""A worker's default limit on one result's arrays (``serve --max-result-bytes``)."""


HIDDEN_ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def result_bytes(
    n_scored: int, spec: TokenOutputs, *, half: bool | None = None, hidden_size: int = 0
) -> int:
    """Bytes of the arrays ``spec`` asks for over ``n_scored`` positions, known before compute.

    ``half`` (default: ``spec.float16``): ``topk_logps`` and ``gather_logps`` travel as float16.
    Per position: 4 per scalar (``logps``, ``entropy``, ``processed_logps``, ``rank``,
    ``topk_tail_logp``),
    ``k * 8`` (or ``k * 6``) for top-k ids + log-probs, ``K * 4`` (or ``K * 2``) for gathered
    log-probs, ``H * 2`` (or ``H * 4`` in float32) for ``hidden`` rows of ``hidden_size`` H.
    """
    value = 2 if (spec.float16 if half is None else half) else 4
    per = 4 * len(spec.outputs & {"logps", "entropy", "processed_logps", "rank"})
    if "topk" in spec.outputs:
        per += spec.topk * (4 + value) + 4
    per += spec.gather_k * value
    if "hidden" in spec.outputs:
        per += hidden_size * HIDDEN_ITEM_BYTES[spec.hidden_dtype]
    return n_scored * per


def array_layout(spec: TokenOutputs, hidden_size: int = 0) -> dict[str, tuple[str, int]]:
    """Every array a result for ``spec`` carries per sequence: name -> (numpy dtype, width).

    The dtype is a little-endian numpy string (``<f4``, ``<f2``, ``<i4``) or ``bf16``; an array
    of ``n`` scored positions has ``n * width`` elements, row-major ``[n, width]``; ``hidden``
    rows are ``hidden_size`` wide.
    """
    value = "<f2" if spec.float16 else "<f4"
    out: dict[str, tuple[str, int]] = {}
    if "logps" in spec.outputs:
        out["logps"] = ("<f4", 1)
    if "entropy" in spec.outputs:
        out["entropy"] = ("<f4", 1)
    if "topk" in spec.outputs:
        out["topk_ids"] = ("<i4", spec.topk)
        out["topk_logps"] = (value, spec.topk)
        out["topk_tail_logp"] = ("<f4", 1)
    if "gather" in spec.outputs:
        out["gather_logps"] = (value, spec.gather_k)
    if "processed_logps" in spec.outputs:
        out["processed_logps"] = ("<f4", 1)
    if "rank" in spec.outputs:
        out["rank"] = ("<i4", 1)
    if "hidden" in spec.outputs:
        out["hidden"] = (HIDDEN_WIRE_DTYPES[spec.hidden_dtype], hidden_size)
    return out


def check_limits(
    spec: TokenOutputs,
    n_scored: int,
    *,
    max_topk: int,
    max_bytes: int,
    hidden_size: int = 0,
    extra_bytes: int = 0,
) -> None:
    """A worker's limits on one job: k at most ``max_topk`` (``BadRequest``), a result of at most
    ``max_bytes`` and of at most the job's own ``spec.max_result_bytes`` (``result_bytes`` over
    the job's ``n_scored`` positions, ``hidden`` rows ``hidden_size`` wide, plus ``extra_bytes``
    of other arrays; ``TooLarge``)."""
    if "topk" in spec.outputs and spec.topk > max_topk:
        raise BadRequest(f"topk k={spec.topk} is over this worker's limit of {max_topk}")
    if "hidden" in spec.outputs and hidden_size < 1:
        raise BadRequest("this worker's scorer serves no 'hidden' rows (no LM head)")
    size = result_bytes(n_scored, spec, hidden_size=hidden_size) + extra_bytes
    own = spec.max_result_bytes
    if size > max_bytes or (own and size > own):
        whose = (
            f"the job's max_result_bytes of {own} bytes"
            if own and own < max_bytes
            else f"this worker's limit of {max_bytes} bytes"
        )
        raise TooLarge(
            f"the result would be {size} bytes ({n_scored} scored positions), over {whose}: "
            f"split the job into smaller ones, lower k, or ask for float16 / bfloat16"
        )


def gather_rows(ids: Any, n_scored: int, spec: TokenOutputs, vocab: int) -> np.ndarray | None:
    """A sequence's per-position gather ids as int64 ``[n_scored, K]``, checked against ``spec``
    (shape, integers) and ``vocab``; ``None`` when the request has no per-position ids (then
    ``ids`` must be ``None`` too). Raises ``BadRequest``."""
    if not spec.gather_width:
        if ids is not None:
            raise BadRequest("gather ids given per sequence but the job asks for no 'gather'")
        return None
    if ids is None:
        raise BadRequest(f"needs gather_ids of shape [{n_scored}, {spec.gather_width}]")
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise BadRequest(f"gather_ids must be integers, got dtype {arr.dtype}")
    if arr.shape != (n_scored, spec.gather_width):
        raise BadRequest(
            f"gather_ids have shape {list(arr.shape)}, expected [{n_scored}, {spec.gather_width}]"
            " (one row of K ids per scored token)"
        )
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab):
        bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
        raise BadRequest(f"gather id {bad} is outside the vocabulary 0..{vocab - 1}")
    return arr.astype(np.int64, copy=False)


def check_call(spec: TokenOutputs, mode: str, vocab: int) -> None:
    """Checks of a scorer call's request: extra outputs need a log-prob mode (``reference`` or
    ``both``), k and shared gather ids must fit ``vocab``. Raises ``BadRequest``."""
    if spec != LOGPS_ONLY and mode not in LOGPROB_MODES:
        raise BadRequest(
            f"outputs {sorted(spec.outputs)} need mode reference or both, not {mode!r}"
        )
    spec.check_vocab(vocab)
