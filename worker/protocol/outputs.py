"""Teacher outputs on the wire: the job keys that ask for them and the result arrays that carry
them (``docs/protocol.md``, "Teacher outputs").

Job keys (all optional; modes ``reference`` and ``both`` only): ``outputs`` (array of names),
``topk`` (int k), ``gather_ids`` (array of K ids shared by every position), ``sampling`` (map of
``top_k``/``top_p``/``min_p``), ``float16`` (bool), ``hidden_dtype`` (``"bfloat16"``,
``"float32"`` or ``"float16"``, with ``"hidden"``), ``max_result_bytes`` (int, the job's own
limit on its result's arrays). A sequence may carry its own ``gather_ids``:
int32 LE bin, row-major ``[n_scored, K]``, the same K for every sequence of the job.

A result that carries teacher arrays has a top-level ``layout`` map, name -> ``[dtype, width]``
(dtype ``"<f4"``, ``"<f2"``, ``"<i4"``, or ``"bf16"``: bfloat16, the upper 16 bits of a float32,
as LE uint16); each ``seqs`` entry then holds every named array as
LE bin of ``n_scored * width`` values, row-major ``[n_scored, width]``.

Decoding checks the structure (types, shapes, sizes) and builds ``worker.request.TokenOutputs``,
which checks what the values may be (known names, k and sampling ranges); what needs the model
or the worker's limits (ids within the vocabulary, the result size) is checked by the worker.
Each refusal is answered ``bad_request``.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from worker.errors import BadRequest, ProtocolError
from worker.request import HIDDEN_WIRE_DTYPES, Sampling, TokenOutputs

__all__ = [
    "ARRAY_DTYPES",
    "HIDDEN_WIRE_DTYPES",
    "JOB_KEYS",
    "array_bin",
    "decode_layout",
    "decode_output_request",
    "encode_output_request",
    "gather_width",
]

JOB_KEYS: tuple[str, ...] = (
    "outputs",
    "topk",
    "gather_ids",
    "sampling",
    "float16",
    "hidden_dtype",
    "max_result_bytes",
)
ARRAY_DTYPES: dict[str, int] = {"<f4": 4, "<f2": 2, "<i4": 4, "bf16": 2}
"""Result array dtypes (numpy strings, little-endian; ``bf16``: bfloat16 bits as LE uint16) and
their item sizes."""

_MAX_NAMES = 16
_MAX_SHARED_IDS = 65536
_SAMPLING_KEYS = ("top_k", "top_p", "min_p")


def _is_int(value: Any) -> bool:
    """An int or an integer scalar (numpy/torch, duck-typed), not a bool."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return hasattr(value, "__index__") and getattr(value, "ndim", 0) == 0


def encode_output_request(request: TokenOutputs) -> dict[str, Any]:
    """The job keys of ``request`` (only those that differ from the defaults)."""
    body: dict[str, Any] = {"outputs": sorted(request.outputs)}
    if "topk" in request.outputs:
        body["topk"] = int(request.topk)
    if request.gather_ids:
        body["gather_ids"] = list(request.gather_ids)
    if request.sampling is not None:
        sampling = request.sampling
        body["sampling"] = {"top_k": sampling.top_k, "top_p": sampling.top_p,
                            "min_p": sampling.min_p}  # fmt: skip
    if request.float16:
        body["float16"] = True
    if "hidden" in request.outputs:
        body["hidden_dtype"] = request.hidden_dtype
    if request.max_result_bytes:
        body["max_result_bytes"] = int(request.max_result_bytes)
    return body


def decode_output_request(
    body: Mapping[str, Any], mode: str, width: int = 0
) -> TokenOutputs | None:
    """The ``TokenOutputs`` of a decoded job body, ``width`` the K of its sequences' own gather
    ids (``None`` when it names none of ``JOB_KEYS``); a reward-only job that asks for outputs
    is refused. Structural checks here; the values are checked by ``TokenOutputs`` itself."""
    if not any(key in body for key in JOB_KEYS):
        return None
    if mode == "reward":
        raise ProtocolError("teacher outputs need mode reference or both, not 'reward'")
    names = body.get("outputs", ("logps",))
    if (
        not isinstance(names, (list, tuple))
        or not 0 < len(names) <= _MAX_NAMES
        or not all(isinstance(n, str) for n in names)
    ):
        raise ProtocolError(f"outputs must be a list of 1..{_MAX_NAMES} names")
    topk = body.get("topk")
    if topk is not None and not _is_int(topk):
        raise ProtocolError(f"topk must be an integer, got {topk!r}")
    ids = body.get("gather_ids")
    if ids is not None:
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) for i in ids):
            raise ProtocolError("gather_ids (shared) must be an array of ints")
        if len(ids) > _MAX_SHARED_IDS:
            raise ProtocolError(f"gather_ids (shared) has more than {_MAX_SHARED_IDS} ids")
    sampling = body.get("sampling")
    if sampling is not None:
        if not isinstance(sampling, Mapping) or not set(sampling) <= set(_SAMPLING_KEYS):
            raise ProtocolError(f"sampling must be a map with keys among {_SAMPLING_KEYS}")
        for key, value in sampling.items():
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float))
            ):
                raise ProtocolError(f"sampling.{key} must be a number, got {value!r}")
    float16 = body.get("float16", False)
    if not isinstance(float16, bool):
        raise ProtocolError("float16 must be true or false")
    hidden_dtype = body.get("hidden_dtype", "bfloat16")
    if not isinstance(hidden_dtype, str):
        raise ProtocolError("hidden_dtype must be a string")
    limit = body.get("max_result_bytes", 0)
    if not _is_int(limit):
        raise ProtocolError(f"max_result_bytes must be an integer, got {limit!r}")
    try:
        if sampling is not None:
            sampling = Sampling(**{k: v for k, v in sampling.items() if v is not None})
        return TokenOutputs(
            outputs=frozenset(names), topk=topk or 0, gather_ids=tuple(ids or ()),
            gather_width=width, sampling=sampling, float16=float16, hidden_dtype=hidden_dtype,
            max_result_bytes=int(limit),
        )  # fmt: skip
    except BadRequest as exc:
        raise ProtocolError(exc.message) from None


def gather_width(counts: Sequence[tuple[int, int | None]]) -> int:
    """K of per-sequence gather ids: ``counts`` holds ``(n_scored, n_ids)`` per sequence
    (``n_ids`` None: no ids). Every sequence carries ids or none does, each ``n_scored * K``
    with the same K >= 1; returns 0 when none does."""
    given = [(i, n, ids) for i, (n, ids) in enumerate(counts) if ids is not None]
    if not given:
        return 0
    if len(given) != len(counts):
        missing = next(i for i, (_, ids) in enumerate(counts) if ids is None)
        raise ProtocolError(f"seqs[{missing}].gather_ids missing: give them for every sequence")
    i, n, ids = given[0]
    width = ids // n if n else 0
    for i, n, ids in given:
        if width < 1 or ids != n * width:
            raise ProtocolError(
                f"seqs[{i}].gather_ids has {ids} ids for {n} scored tokens: expected "
                f"n_scored x K with one K >= 1 for every sequence (K = {width} from seqs[0])"
            )
    return width


def array_bin(values: Any, dtype: str) -> bytes:
    """``values`` as LE bin of ``dtype`` (``ARRAY_DTYPES``): a numpy array (cast), bytes (as
    they are) or an ``array`` of the matching typecode."""
    if isinstance(values, (bytes, bytearray, memoryview)):
        return bytes(values)
    if dtype == "bf16":  # the bits as uint16 (a numpy array of them)
        if not hasattr(values, "view") or getattr(values, "itemsize", 0) != 2:
            raise ProtocolError("encoding bf16 needs its bits as a 2-byte numpy array")
        return values.view("<u2").tobytes()
    if hasattr(values, "astype") and hasattr(values, "tobytes"):
        return values.astype(dtype, copy=False).tobytes()
    code = {"<f4": "f", "<i4": "i"}.get(dtype)
    if code is None:
        raise ProtocolError(f"encoding {dtype} needs a numpy array")
    arr = values if isinstance(values, array) and values.typecode == code else array(code, values)
    if sys.byteorder != "little":
        arr = array(code, arr)
        arr.byteswap()
    return arr.tobytes()


def decode_layout(raw: Any) -> dict[str, tuple[str, int]]:
    """A result's ``layout`` map (name -> ``[dtype, width]``), checked."""
    if not isinstance(raw, Mapping):
        raise ProtocolError("result layout must be a map of name -> [dtype, width]")
    out: dict[str, tuple[str, int]] = {}
    for name, spec in raw.items():
        if (
            not isinstance(spec, (list, tuple))
            or len(spec) != 2
            or spec[0] not in ARRAY_DTYPES
            or isinstance(spec[1], bool)
            or not isinstance(spec[1], int)
            or spec[1] < 1
        ):
            raise ProtocolError(f"result layout[{name!r}] must be [dtype, width >= 1]")
        out[str(name)] = (spec[0], spec[1])
    return out
