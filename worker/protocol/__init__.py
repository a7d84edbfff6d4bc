"""Wire protocol v1: the msgpack schema of jobs and results (see ``docs/protocol.md``).

This module knows msgpack and the standard library only: no torch, no redis, no numpy
requirement (numpy/torch arrays are accepted duck-typed when the caller has them).
Decoding is strict and bounded: every size is checked against :class:`Limits` before
anything proportional to it is allocated, and pickle is never involved.
"""

from __future__ import annotations

import contextlib
import io
import math
import operator
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from worker.errors import ERROR_CODES, ProtocolError

PROTOCOL_VERSION = 1
PAYLOAD_FIELD = b"payload"
MODES: tuple[str, ...] = ("reference", "reward", "both")
MAX_ID_CHARS = 128
MAX_KEY_CHARS = 512
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_LITTLE = sys.byteorder == "little"


@dataclass(frozen=True)
class Limits:
    """Bounds applied while decoding a job payload (all counts are per job)."""

    max_payload_bytes: int = 64 * 1024 * 1024
    max_seqs: int = 4096
    max_tokens: int = 4 * 1024 * 1024
    max_meta_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        for name in ("max_payload_bytes", "max_seqs", "max_tokens", "max_meta_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name} must be > 0, got {getattr(self, name)}")


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class SeqSpec:
    """One sequence of a job: int32 token ids and what to score.

    Exactly one of ``prompt_len`` (tokens from ``prompt_len`` on are scored) and ``mask``
    (one byte per token, 1 = scored, first byte 0) is set.
    """

    tokens: array  # typecode "i" (int32), native byte order
    prompt_len: int | None = None
    mask: bytes | None = None

    @property
    def num_scored(self) -> int:
        """How many tokens of this sequence are scored."""
        if self.mask is not None:
            return sum(self.mask)
        assert self.prompt_len is not None
        return len(self.tokens) - self.prompt_len


@dataclass(frozen=True)
class Job:
    """A decoded, schema-valid job."""

    id: str
    mode: str
    reply_to: str
    seqs: tuple[SeqSpec, ...]
    temperature: float = 1.0
    deadline_ms: int | None = None
    meta: Any = None

    @property
    def num_tokens(self) -> int:
        """Total tokens over all sequences."""
        return sum(len(s.tokens) for s in self.seqs)


@dataclass
class SeqResult:
    """The scores of one sequence: log-probs (float32, one per scored token) and/or a reward."""

    logps: array | None = None  # typecode "f"
    reward: float | None = None
    token_scores: array | None = None  # typecode "f", optional per-token reward-head scores


@dataclass
class Result:
    """One result entry: ``ok`` with ``seqs``, or not ok with ``error`` ``{code, message}``."""

    id: str
    ok: bool
    seqs: list[SeqResult] = field(default_factory=list)
    error: dict[str, str] | None = None
    meta: Any = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def code(self) -> str | None:
        """The error code, or ``None`` for a successful result."""
        return self.error["code"] if self.error else None


# ----------------------------------------------------------------------------- helpers


def _le_bytes(arr: array) -> bytes:
    """Little-endian bytes of a numeric array."""
    if _LITTLE:
        return arr.tobytes()
    swapped = array(arr.typecode, arr)
    swapped.byteswap()
    return swapped.tobytes()


def _from_le(typecode: str, data: bytes | memoryview) -> array:
    out = array(typecode)
    out.frombytes(bytes(data))
    if not _LITTLE:
        out.byteswap()
    return out


def as_int32_array(tokens: Any) -> array:
    """Coerce token ids (list, tuple, ``array``, bytes of LE int32, numpy/torch) to ``array('i')``.

    A list or tuple may hold ints or integer scalars (numpy integers, 0-d integer numpy arrays or
    torch tensors, see ``token_id``). Raises ``ProtocolError`` for values outside int32 and for
    non-integer input (floats, booleans, strings...).
    """
    if isinstance(tokens, array):
        if tokens.typecode == "i":
            return tokens
        return as_int32_array(tokens.tolist())
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        data = bytes(tokens)
        if len(data) % 4:
            raise ProtocolError(f"tokens bin has {len(data)} bytes, not a multiple of 4 (int32)")
        return _from_le("i", data)
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # a torch tensor, duck-typed
        tokens = tokens.detach().cpu().numpy()
    if hasattr(tokens, "__array__") and hasattr(tokens, "dtype"):  # numpy, duck-typed
        kind = getattr(tokens.dtype, "kind", "")
        if kind not in ("i", "u"):
            raise ProtocolError(f"tokens must be integers, got array of dtype {tokens.dtype}")
        if getattr(tokens, "ndim", 1) != 1:
            raise ProtocolError(f"tokens must be 1-D, got shape {tokens.shape}")
        if tokens.size and (int(tokens.min()) < _INT32_MIN or int(tokens.max()) > _INT32_MAX):
            raise ProtocolError("token id outside int32")
        return _from_le("i", tokens.astype("<i4", copy=False).tobytes())
    if isinstance(tokens, (list, tuple)):
        values: Any = tokens
        for t in tokens:
            if not isinstance(t, int) or isinstance(t, bool):  # numpy/torch scalars, or bad
                values = [token_id(x, i) for i, x in enumerate(tokens)]
                break
        try:
            return array("i", values)
        except OverflowError as exc:
            raise ProtocolError("token id outside int32") from exc
    raise ProtocolError(f"tokens must be a list of ints or int32 bin, got {type(tokens).__name__}")


def is_bool_like(value: Any) -> bool:
    """A Python, numpy or torch boolean scalar (or 0-d boolean array/tensor)."""
    if isinstance(value, bool):
        return True
    dtype = getattr(value, "dtype", None)
    if dtype is None or getattr(value, "ndim", 0) != 0:
        return False
    return getattr(dtype, "kind", "") == "b" or str(dtype) == "torch.bool"


def token_id(value: Any, index: int = 0) -> int:
    """One token id as a Python int: an int or any integer scalar with ``__index__`` (numpy
    integer scalars, 0-d integer arrays and torch tensors). Booleans and floats are rejected."""
    what = type(value).__name__
    if is_bool_like(value):
        raise ProtocolError(f"token ids must be integers, got a boolean ({what}) at index {index}")
    if getattr(value, "ndim", 0) != 0:
        raise ProtocolError(f"token ids must be integer scalars, got a {what} at index {index}")
    try:
        return operator.index(value)
    except TypeError:
        dtype = getattr(value, "dtype", None)
        kind = f"{what} of dtype {dtype}" if dtype is not None and str(dtype) != what else what
        raise ProtocolError(f"token ids must be integers, got {kind} at index {index}") from None


def as_mask_bytes(mask: Any) -> bytes:
    """Coerce a completion mask (list of 0/1, bytes, numpy/torch bool/int) to bytes."""
    if isinstance(mask, (bytes, bytearray, memoryview)):
        return bytes(mask)
    if hasattr(mask, "detach") and hasattr(mask, "cpu"):
        mask = mask.detach().cpu().numpy()
    if hasattr(mask, "__array__") and hasattr(mask, "dtype"):
        return bytes(mask.astype("u1").tolist())
    if isinstance(mask, (list, tuple)):
        try:
            return bytes(int(m) for m in mask)
        except (TypeError, ValueError) as exc:
            raise ProtocolError("mask must hold 0/1 values") from exc
    raise ProtocolError(f"mask must be bin or an array of 0/1, got {type(mask).__name__}")


def validate_seq(tokens: array, prompt_len: Any, mask: bytes | None, index: int) -> None:
    """Structural checks of one sequence (lengths, prompt_len range, mask values)."""
    n = len(tokens)
    where = f"seqs[{index}]"
    if n < 2:
        raise ProtocolError(
            f"{where}: needs at least 2 tokens (the first is never scored), got {n}"
        )
    if (prompt_len is None) == (mask is None):
        raise ProtocolError(f"{where}: give exactly one of prompt_len and mask")
    if prompt_len is not None:
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int):
            raise ProtocolError(f"{where}: prompt_len must be an int")
        if not 1 <= prompt_len < n:
            raise ProtocolError(f"{where}: prompt_len {prompt_len} outside [1, {n})")
    if mask is not None:
        if len(mask) != n:
            raise ProtocolError(f"{where}: mask has {len(mask)} entries for {n} tokens")
        if mask.strip(b"\x00\x01"):
            raise ProtocolError(f"{where}: mask values must be 0 or 1")
        if mask[0]:
            raise ProtocolError(f"{where}: mask[0] must be 0 (the first token has no context)")
        if 1 not in mask:
            raise ProtocolError(f"{where}: mask scores no token")


# ----------------------------------------------------------------------------- jobs


def encode_job(
    job_id: str,
    mode: str,
    reply_to: str,
    seqs: Iterable[Mapping[str, Any] | SeqSpec],
    *,
    temperature: float = 1.0,
    deadline_ms: int | None = None,
    meta: Any = None,
) -> bytes:
    """Encode a job payload; each seq is a ``SeqSpec`` or a map with ``tokens`` and
    ``prompt_len`` or ``mask``. Validates structure so producers fail fast."""
    if not isinstance(job_id, str) or not 0 < len(job_id) <= MAX_ID_CHARS:
        raise ProtocolError(f"job id must be a non-empty string of at most {MAX_ID_CHARS} chars")
    if mode not in MODES:
        raise ProtocolError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(reply_to, str) or not 0 < len(reply_to) <= MAX_KEY_CHARS:
        raise ProtocolError("reply_to must be a non-empty stream key")
    if not (
        isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0
    ):
        raise ProtocolError(f"temperature must be a finite number > 0, got {temperature!r}")
    wire_seqs = []
    for i, s in enumerate(seqs):
        if isinstance(s, SeqSpec):
            tokens, prompt_len, mask = s.tokens, s.prompt_len, s.mask
        else:
            tokens = as_int32_array(s["tokens"])
            prompt_len = s.get("prompt_len")
            mask = as_mask_bytes(s["mask"]) if s.get("mask") is not None else None
        validate_seq(tokens, prompt_len, mask, i)
        entry: dict[str, Any] = {"tokens": _le_bytes(tokens)}
        if prompt_len is not None:
            entry["prompt_len"] = int(prompt_len)
        else:
            entry["mask"] = mask
        wire_seqs.append(entry)
    if not wire_seqs:
        raise ProtocolError("a job needs at least one sequence")
    body: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "id": job_id,
        "mode": mode,
        "reply_to": reply_to,
        "seqs": wire_seqs,
        "temperature": float(temperature),
    }
    if deadline_ms is not None:
        body["deadline_ms"] = int(deadline_ms)
    if meta is not None:
        body["meta"] = meta
    return msgpack.packb(body, use_bin_type=True)


def _unpack(payload: bytes | memoryview, limits: Limits) -> Any:
    """msgpack-decode with every container and string bounded by ``limits``."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) > limits.max_payload_bytes:
        raise ProtocolError(
            f"payload is {len(payload)} bytes, over the limit of {limits.max_payload_bytes}",
            raw=bytes(payload[:256]),
        )
    # Each map/array costs >= 1 byte on the wire but ~60 bytes in Python: count them while
    # unpacking and stop once there are more than a valid job can hold.
    budget = [4 * limits.max_seqs + limits.max_meta_bytes + 16]

    def _count(obj: Any) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError("too many maps/arrays for a job")
        return obj

    try:
        return msgpack.unpackb(
            payload,
            object_hook=_count,
            list_hook=_count,
            raw=False,
            strict_map_key=True,
            max_bin_len=limits.max_payload_bytes,
            max_str_len=limits.max_meta_bytes,
            # Every element takes >= 1 byte (a map entry >= 2): capping the declared lengths by
            # the payload size stops a tiny header from pre-allocating a huge list.
            max_array_len=min(max(limits.max_seqs, limits.max_tokens), len(payload)),
            max_map_len=min(1024, len(payload) // 2),
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises a zoo of exception types for bad input
        raise ProtocolError(
            f"payload is not valid msgpack: {_unpack_hint(exc, limits)}", raw=bytes(payload[:256])
        ) from exc


def _unpack_hint(exc: Exception, limits: Limits) -> str:
    """The unpacker's error, prefixed with the protocol rule it breaks when that is known."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, UnicodeDecodeError):
        rule = "str values must be valid UTF-8 (send bytes as bin, e.g. use_bin_type=True)"
    elif "max_ext_len" in text:
        rule = "ext types (including msgpack timestamps) are not accepted"
    elif "map key" in text:
        rule = "map keys must be str or bin (also inside meta)"
    elif "max_str_len" in text:
        rule = f"a str is longer than {limits.max_meta_bytes} bytes"
    elif isinstance(exc, msgpack.StackError):
        rule = "containers nested too deep"
    else:
        return text
    return f"{rule} ({text})"


#: Top-level keys ``peek_envelope`` reads, and the most wire bytes each value may take (meta:
#: ``Limits.max_meta_bytes``); a longer value is skipped unread.
_PEEK_BOUNDS: dict[str, int | None] = {
    "v": 9,
    "id": 3 + 4 * MAX_ID_CHARS,
    "reply_to": 3 + 4 * MAX_KEY_CHARS,
    "meta": None,
}
#: The usual (fixstr) encoding of each wanted key, matched without decoding.
_PEEK_KEY_BYTES = {msgpack.packb(k): k for k in _PEEK_BOUNDS}
_STR_8_16_32 = (0xD9, 0xDA, 0xDB)
_PEEK_MAX_PAIRS = 1024  # a valid job has < 10 top-level keys; _unpack rejects maps above 1024
_PEEK_READ_SIZE = 64 * 1024
_PEEK_MIN_BUFFER = 1024 * 1024


def _top_level_spans(payload: bytes, max_buffer: int) -> dict[str, tuple[int, int]]:
    """Byte spans ``(start, end)`` of the values of the ``_PEEK_BOUNDS`` keys of a top-level map.

    Never builds a value: the unpacker only skips over them (without the length checks that
    apply to built values) and reads the payload in ``_PEEK_READ_SIZE`` chunks, so its buffer
    holds one chunk or the single str/bin being skipped (at most ``max_buffer`` bytes; a longer
    one ends the walk), never a decoded tree. Returns what was found before the payload ended or
    turned out to be garbage; the last occurrence of a duplicated key wins (as in ``decode_job``).
    """
    size = len(payload)
    read_size = max(1, min(size, _PEEK_READ_SIZE))
    unpacker = msgpack.Unpacker(
        io.BytesIO(payload),
        read_size=read_size,
        max_buffer_size=max(min(size, max_buffer), read_size),
        raw=False,
        # This unpacker builds nothing (read_map_header and skip only; the wanted values are
        # decoded from their spans afterwards): the bounds are the bytes that are there.
        max_str_len=size,
        max_bin_len=size,
        max_array_len=size,
        max_map_len=size,
        max_ext_len=size,
    )
    spans: dict[str, tuple[int, int]] = {}
    try:
        pairs = unpacker.read_map_header()
        for _ in range(min(pairs, _PEEK_MAX_PAIRS)):
            key_start = unpacker.tell()
            unpacker.skip()
            value_start = unpacker.tell()
            unpacker.skip()
            if value_start - key_start > 16:  # longer than any wanted key's encoding
                continue
            raw_key = payload[key_start:value_start]
            key = _PEEK_KEY_BYTES.get(raw_key)
            if key is None and raw_key[0] in _STR_8_16_32:
                try:  # a wanted key in a longer str encoding is still that key
                    key = msgpack.unpackb(raw_key, raw=False)
                except Exception:  # not UTF-8, ...: not a key we want
                    continue
            if key in _PEEK_BOUNDS:
                spans[key] = (value_start, unpacker.tell())
    except Exception:  # not a map, truncated, nested too deep, ...: keep what was found
        pass
    return spans


def _unpack_scalar(data: memoryview, max_len: int) -> Any:
    """Decode a small top-level value (``v``, ``id``, ``reply_to``) strictly; ``None`` if it is
    not valid msgpack. Containers come back empty or fail, so nothing big is built."""
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            max_str_len=max_len,
            max_bin_len=max_len,
            max_array_len=0,
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception:
        return None


def peek_envelope(payload: bytes, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Best-effort read of ``v``, ``id``, ``reply_to`` and ``meta`` from a payload that may be
    invalid, to address an error result; never raises.

    Works on payloads that break a limit (over ``max_payload_bytes``, too many tokens, a bad
    ``meta``...): the top-level map is walked without decoding the other values. Memory beyond the
    payload is one read buffer of at most ``max(limits.max_payload_bytes, 1 MiB)`` (it must hold
    the largest single str/bin skipped; past a longer one the walk stops with what it found) plus
    the few small values read. Returns only the keys that are readable and well-typed: ``v``
    (int), ``id`` (1..128 chars), ``reply_to`` (1..512 chars), ``meta`` (left out unless it
    decodes under the same strict rules as ``decode_job`` within ``limits.max_meta_bytes`` wire
    bytes).
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)) or not len(payload):
        return {}
    if not isinstance(payload, bytes):
        payload = bytes(payload)
    max_buffer = max(limits.max_payload_bytes, _PEEK_MIN_BUFFER)
    view = memoryview(payload)
    out: dict[str, Any] = {}
    for key, (start, end) in _top_level_spans(payload, max_buffer).items():
        bound = _PEEK_BOUNDS[key]
        if bound is None:  # meta
            bound = limits.max_meta_bytes
            if end - start <= bound:
                meta_limits = Limits(
                    max_payload_bytes=bound,
                    max_seqs=limits.max_seqs,
                    max_tokens=limits.max_tokens,
                    max_meta_bytes=bound,
                )
                with contextlib.suppress(ProtocolError):
                    out["meta"] = _unpack(view[start:end], meta_limits)
            continue
        if end - start > bound:
            continue
        value = _unpack_scalar(view[start:end], bound)
        if key == "v":
            if isinstance(value, int) and not isinstance(value, bool):
                out["v"] = value
        elif isinstance(value, str) and 0 < len(value) <= (
            MAX_ID_CHARS if key == "id" else MAX_KEY_CHARS
        ):
            out[key] = value
    return out


def decode_job(payload: bytes, limits: Limits = DEFAULT_LIMITS) -> Job:
    """Decode and validate a job payload. Raises ``ProtocolError`` (code ``bad_request``)."""
    body = _unpack(payload, limits)
    raw = bytes(payload[:256])
    if not isinstance(body, dict):
        raise ProtocolError("payload must be a msgpack map", raw=raw)
    v = body.get("v")
    if isinstance(v, bool) or not isinstance(v, int) or v != PROTOCOL_VERSION:  # 1.0, true: no
        raise ProtocolError(f"unsupported protocol version {v!r} (this worker speaks v1)", raw=raw)
    job_id = body.get("id")
    if not isinstance(job_id, str) or not 0 < len(job_id) <= MAX_ID_CHARS:
        raise ProtocolError(
            f"id must be a non-empty string of at most {MAX_ID_CHARS} chars", raw=raw
        )
    reply_to = body.get("reply_to")
    if not isinstance(reply_to, str) or not 0 < len(reply_to) <= MAX_KEY_CHARS:
        raise ProtocolError("reply_to must be a non-empty string", raw=raw)
    mode = body.get("mode")
    if not isinstance(mode, str):
        raise ProtocolError("mode must be a string", raw=raw)
    temperature = body.get("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ProtocolError("temperature must be a number", raw=raw)
    if not (math.isfinite(temperature) and temperature > 0):
        raise ProtocolError(f"temperature must be finite and > 0, got {temperature}", raw=raw)
    deadline_ms = body.get("deadline_ms")
    if deadline_ms is not None and (
        isinstance(deadline_ms, bool) or not isinstance(deadline_ms, int)
    ):
        raise ProtocolError("deadline_ms must be an integer (unix milliseconds)", raw=raw)
    meta = body.get("meta")
    if meta is not None and len(msgpack.packb(meta, use_bin_type=True)) > limits.max_meta_bytes:
        raise ProtocolError(f"meta is larger than {limits.max_meta_bytes} bytes", raw=raw)
    raw_seqs = body.get("seqs")
    if not isinstance(raw_seqs, list) or not raw_seqs:
        raise ProtocolError("seqs must be a non-empty array", raw=raw)
    if len(raw_seqs) > limits.max_seqs:
        raise ProtocolError(
            f"{len(raw_seqs)} sequences, over the limit of {limits.max_seqs}", raw=raw
        )
    seqs: list[SeqSpec] = []
    total = 0
    for i, s in enumerate(raw_seqs):
        if not isinstance(s, dict):
            raise ProtocolError(f"seqs[{i}] must be a map", raw=raw)
        raw_tokens = s.get("tokens")
        n = len(raw_tokens) // 4 if isinstance(raw_tokens, bytes) else None
        if isinstance(raw_tokens, list):
            n = len(raw_tokens)
        if n is None:
            hint = ""
            if isinstance(raw_tokens, str):
                hint = " (got str: pack bytes as bin, e.g. use_bin_type=True)"
            raise ProtocolError(
                f"seqs[{i}].tokens must be int32 bin or an array of ints{hint}", raw=raw
            )
        total += n
        if total > limits.max_tokens:
            raise ProtocolError(f"job has more than {limits.max_tokens} tokens", raw=raw)
        try:
            tokens = as_int32_array(raw_tokens)
        except ProtocolError as exc:
            raise ProtocolError(f"seqs[{i}].tokens: {exc.message}", raw=raw) from exc
        prompt_len = s.get("prompt_len")
        mask = s.get("mask")
        if mask is not None and not isinstance(mask, bytes):
            if isinstance(mask, list) and all(isinstance(m, int) for m in mask):
                mask = as_mask_bytes(mask)
            else:
                raise ProtocolError(f"seqs[{i}].mask must be bin (one uint8 per token)", raw=raw)
        validate_seq(tokens, prompt_len, mask, i)
        seqs.append(SeqSpec(tokens=tokens, prompt_len=prompt_len, mask=mask))
    return Job(
        id=job_id,
        mode=mode,
        reply_to=reply_to,
        seqs=tuple(seqs),
        temperature=float(temperature),
        deadline_ms=deadline_ms,
        meta=meta,
    )


# ----------------------------------------------------------------------------- results


def _float_bin(values: Any) -> bytes:
    """Little-endian float32 bytes from an ``array('f')``, numpy array, or sequence of floats."""
    if isinstance(values, array) and values.typecode == "f":
        return _le_bytes(values)
    if hasattr(values, "__array__") and hasattr(values, "astype"):
        return values.astype("<f4", copy=False).tobytes()
    return _le_bytes(array("f", values))


def encode_result(result: Result) -> bytes:
    """Encode a result payload."""
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": result.id, "ok": bool(result.ok)}
    if result.ok:
        seqs = []
        for s in result.seqs:
            entry: dict[str, Any] = {}
            if s.logps is not None:
                entry["logps"] = _float_bin(s.logps)
            if s.reward is not None:
                entry["reward"] = float(s.reward)
            if s.token_scores is not None:
                entry["token_scores"] = _float_bin(s.token_scores)
            seqs.append(entry)
        body["seqs"] = seqs
    else:
        if not result.error or result.error.get("code") not in ERROR_CODES:
            raise ValueError(f"an error result needs error.code in {ERROR_CODES}")
        body["error"] = {
            "code": result.error["code"],
            "message": str(result.error.get("message", "")),
        }
    if result.meta is not None:
        body["meta"] = result.meta
    if result.info:
        body["info"] = result.info
    return msgpack.packb(body, use_bin_type=True)


def error_result(
    job_id: str, code: str, message: str, *, meta: Any = None, info: Any = None
) -> Result:
    """Build an error result."""
    return Result(
        id=job_id,
        ok=False,
        error={"code": code, "message": message},
        meta=meta,
        info=dict(info or {}),
    )


def decode_result(payload: bytes, limits: Limits = DEFAULT_LIMITS) -> Result:
    """Decode a result payload (used by producers)."""
    body = _unpack(payload, limits)
    if not isinstance(body, dict) or body.get("v") != PROTOCOL_VERSION:
        raise ProtocolError("result payload is not a v1 map", raw=bytes(payload[:256]))
    job_id = body.get("id")
    if not isinstance(job_id, str):
        raise ProtocolError("result has no id", raw=bytes(payload[:256]))
    ok = bool(body.get("ok"))
    raw_seqs = body.get("seqs") or []
    if not isinstance(raw_seqs, list) or not all(isinstance(s, dict) for s in raw_seqs):
        raise ProtocolError("result seqs must be an array of maps", raw=bytes(payload[:256]))
    seqs: list[SeqResult] = []
    for s in raw_seqs:
        logps = s.get("logps")
        token_scores = s.get("token_scores")
        reward = s.get("reward")
        for value in (logps, token_scores):
            if isinstance(value, bytes) and len(value) % 4:
                raise ProtocolError("result float32 bin length is not a multiple of 4")
        if isinstance(reward, bool) or not isinstance(reward, (int, float, type(None))):
            raise ProtocolError("result reward must be a number")
        seqs.append(
            SeqResult(
                logps=_from_le("f", logps) if isinstance(logps, bytes) else None,
                reward=reward,
                token_scores=_from_le("f", token_scores)
                if isinstance(token_scores, bytes)
                else None,
            )
        )
    raw_error = body.get("error")
    error = {"code": "internal", "message": "error result without an error map"}
    if isinstance(raw_error, dict) and isinstance(raw_error.get("code"), str):
        error = {"code": raw_error["code"], "message": str(raw_error.get("message", ""))}
    info = body.get("info")
    return Result(
        id=job_id,
        ok=ok,
        seqs=seqs,
        error=error if not ok else None,
        meta=body.get("meta"),
        info=info if isinstance(info, dict) else {},
    )


def seq_specs(seqs: Sequence[Mapping[str, Any]]) -> list[SeqSpec]:
    """Build validated ``SeqSpec`` objects from maps with ``tokens`` and ``prompt_len``/``mask``."""
    out = []
    for i, s in enumerate(seqs):
        tokens = as_int32_array(s["tokens"])
        mask = as_mask_bytes(s["mask"]) if s.get("mask") is not None else None
        prompt_len = s.get("prompt_len")
        validate_seq(tokens, prompt_len, mask, i)
        out.append(SeqSpec(tokens=tokens, prompt_len=prompt_len, mask=mask))
    return out
