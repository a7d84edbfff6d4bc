"""The teacher-output request of a job, torch-free: which per-position arrays it wants.

``TokenOutputs`` (with its ``Sampling``) is the one definition of what a job may ask for beyond
log-probs, and of its validation: built from the wire by the daemon's intake, carried on
``ScoreOptions.outputs``, and read by the executor's math (``worker.executor.head.teacher``) and the
no-op scorer. ``result_bytes`` sizes a result before any compute; ``array_layout`` names the dtype
and width of every array a result carries (``docs/protocol.md``). Every check raises
``BadRequest`` with the reason.

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
======================  ========================  ==========================================
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from worker.errors import BadRequest
from worker.modes import LOGPROB_MODES

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

OUTPUT_NAMES: tuple[str, ...] = (
    "logps",
    "entropy",
    "topk",
    "gather",
    "processed_logps",
    "rank",
)
MAX_TOPK = 256
"""The largest k a job may ask for (a worker may lower it: ``serve --max-topk``)."""
MAX_GATHER_IDS = 4096
DEFAULT_MAX_RESULT_BYTES = 64 * 1024 * 1024
SORT_FREE_TOP_K = 256
"""Without top-p, a top-k up to this k is found with ``torch.topk``; a larger one with a sort."""


def _integer(name: str, value: Any, lo: int, hi: int) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or not lo <= int(value) <= hi
    ):
        raise BadRequest(f"{name} must be an integer in {lo}..{hi}, got {value!r}")
    return int(value)


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise BadRequest(f"sampling.{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Sampling:
    """Sampler parameters; ``top_k`` 0/None, ``top_p`` 1.0 and ``min_p`` 0.0 switch a filter off.

    Raises ``BadRequest`` unless ``top_k`` is an int >= 0, ``0 < top_p <= 1``, ``0 <= min_p <= 1``.
    """

    top_k: int | None = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        top_k = 0 if self.top_k is None else self.top_k
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
            raise BadRequest(f"sampling.top_k must be an integer >= 0 (0 = off), got {top_k!r}")
        top_p = _real("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise BadRequest(f"sampling.top_p must be in (0, 1] (1 = off), got {top_p!r}")
        min_p = _real("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise BadRequest(f"sampling.min_p must be in [0, 1] (0 = off), got {min_p!r}")
        object.__setattr__(self, "top_k", int(top_k))
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "min_p", min_p)

    def top_k_for(self, vocab: int) -> int:
        """The effective k: 0 when top-k is off or keeps the whole vocabulary."""
        k = int(self.top_k or 0)
        return k if 0 < k < vocab else 0

    def needs_sort(self, vocab: int) -> bool:
        """Whether the support needs a full ``[c, V]`` sort (top-p, or a top-k above 256)."""
        return self.top_p < 1.0 or self.top_k_for(vocab) > SORT_FREE_TOP_K


@dataclass(frozen=True)
class TokenOutputs:
    """Which per-position arrays a job wants, and their parameters. Validated on construction.

    ``outputs``: names from ``OUTPUT_NAMES``. ``topk``: k in 1..256, required with (and only
    with) ``"topk"``. ``"gather"`` takes either shared ``gather_ids`` (K ids used at every
    position) or ``gather_width`` K > 0, the width of the per-position ids each sequence carries
    (``[n_scored, K]``); K <= 4096. ``sampling`` is required with (and only with)
    ``"processed_logps"``. ``float16``: ``topk_logps`` and ``gather_logps`` travel as float16
    (the math stays float32). ``temperature`` is the call's (the executor sets it). Raises
    ``BadRequest`` with the reason.
    """

    outputs: frozenset[str] = frozenset({"logps"})
    topk: int = 0
    gather_ids: tuple[int, ...] = ()
    gather_width: int = 0
    sampling: Sampling | None = None
    temperature: float = 1.0
    float16: bool = False

    def __post_init__(self) -> None:
        names = (self.outputs,) if isinstance(self.outputs, str) else self.outputs
        if not isinstance(names, Iterable) or not all(isinstance(n, str) for n in names):
            raise BadRequest(f"outputs must be a list of names, got {self.outputs!r}")
        outputs = frozenset(names)
        unknown = sorted(outputs - set(OUTPUT_NAMES))
        if unknown or not outputs:
            raise BadRequest(f"unknown or no outputs {unknown}; expected some of {OUTPUT_NAMES}")
        object.__setattr__(self, "outputs", outputs)
        if "topk" in outputs:
            object.__setattr__(self, "topk", _integer("topk k", self.topk, 1, MAX_TOPK))
        elif self.topk:
            raise BadRequest(f"topk k={self.topk!r} given but 'topk' is not a requested output")
        self._check_gather()
        if isinstance(self.sampling, dict):
            try:
                object.__setattr__(self, "sampling", Sampling(**self.sampling))
            except TypeError:
                known = ("top_k", "top_p", "min_p")
                raise BadRequest(
                    f"sampling keys {sorted(self.sampling)} not all in {known}"
                ) from None
        if ("processed_logps" in outputs) != (self.sampling is not None):
            raise BadRequest("'processed_logps' and sampling go together: give both or neither")
        if self.sampling is not None and not isinstance(self.sampling, Sampling):
            raise BadRequest(f"sampling must be a Sampling, got {type(self.sampling).__name__}")
        temperature = self.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
            raise BadRequest(f"temperature must be a number, got {temperature!r}")
        if not (temperature > 0 and math.isfinite(temperature)):
            raise BadRequest(f"temperature must be a finite number > 0, got {temperature!r}")
        object.__setattr__(self, "temperature", float(temperature))
        if not isinstance(self.float16, bool):
            raise BadRequest(f"float16 must be true or false, got {self.float16!r}")

    def _check_gather(self) -> None:
        ids = self.gather_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise BadRequest(f"gather_ids must be a list of token ids, got {ids!r}")
        ids = tuple(ids)
        for i in ids:
            _integer("gather_ids entries", i, 0, 2**31 - 1)
        object.__setattr__(self, "gather_ids", tuple(int(i) for i in ids))
        width = self.gather_width
        if "gather" not in self.outputs:
            if ids or width:
                raise BadRequest("gather ids given but 'gather' is not a requested output")
            return
        if bool(ids) == bool(width):
            raise BadRequest("'gather' needs exactly one of gather_ids (shared) or gather_width")
        if ids:
            _integer("number of gather_ids", len(ids), 1, MAX_GATHER_IDS)
        else:
            _integer("gather_width", width, 1, MAX_GATHER_IDS)

    @property
    def gather_k(self) -> int:
        """K, the number of gathered ids per position (0 without ``"gather"``)."""
        return len(self.gather_ids) or self.gather_width

    @property
    def extra(self) -> bool:
        """Whether anything beyond plain ``logps`` is asked for."""
        return self.outputs != LOGPS_ONLY.outputs or self.float16

    def check_vocab(self, vocab: int) -> None:
        """Raise ``BadRequest`` when k or a shared gather id does not fit ``vocab`` tokens."""
        if "topk" in self.outputs and self.topk > vocab:
            raise BadRequest(f"topk k={self.topk} exceeds the model's vocabulary of {vocab}")
        bad = [i for i in self.gather_ids if i >= vocab]
        if bad:
            raise BadRequest(f"gather_ids {bad[:8]} are outside the vocabulary 0..{vocab - 1}")


LOGPS_ONLY = TokenOutputs()
"""Today's request: the log-prob of each scored token, nothing more."""


def result_bytes(n_scored: int, spec: TokenOutputs, *, half: bool | None = None) -> int:
    """Bytes of the arrays ``spec`` asks for over ``n_scored`` positions, known before compute.

    ``half`` (default: ``spec.float16``): ``topk_logps`` and ``gather_logps`` travel as float16.
    Per position: 4 per scalar (``logps``, ``entropy``, ``processed_logps``, ``rank``,
    ``topk_tail_logp``),
    ``k * 8`` (or ``k * 6``) for top-k ids + log-probs, ``K * 4`` (or ``K * 2``) for gathered
    log-probs.
    """
    value = 2 if (spec.float16 if half is None else half) else 4
    per = 4 * len(spec.outputs & {"logps", "entropy", "processed_logps", "rank"})
    if "topk" in spec.outputs:
        per += spec.topk * (4 + value) + 4
    per += spec.gather_k * value
    return n_scored * per


def array_layout(spec: TokenOutputs) -> dict[str, tuple[str, int]]:
    """Every array a result for ``spec`` carries per sequence: name -> (numpy dtype, width).

    The dtype is a little-endian numpy string (``<f4``, ``<f2``, ``<i4``); an array of ``n``
    scored positions has ``n * width`` elements, row-major ``[n, width]``.
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
    return out


def check_limits(spec: TokenOutputs, n_scored: int, *, max_topk: int, max_bytes: int) -> None:
    """A worker's limits on one job: k at most ``max_topk``, a result of at most ``max_bytes``
    (``result_bytes`` over the job's ``n_scored`` positions). Raises ``BadRequest``."""
    if "topk" in spec.outputs and spec.topk > max_topk:
        raise BadRequest(f"topk k={spec.topk} is over this worker's limit of {max_topk}")
    size = result_bytes(n_scored, spec)
    if size > max_bytes:
        raise BadRequest(
            f"the result would be {size} bytes ({n_scored} scored positions), over this "
            f"worker's limit of {max_bytes} bytes: split the job into smaller ones, lower k, "
            f"or ask for float16"
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
