"""Reading the envelope (``v``, ``id``, ``reply_to``, ``meta``) of a payload that may be invalid.

A job that breaks a limit (over ``max_payload_bytes``, too many tokens, a bad ``meta``...) still
deserves an error result, so the worker needs its ``id`` and ``reply_to`` without decoding it.

How the walk stays bounded (behaviour of ``msgpack.Unpacker``, checked on msgpack 1.x; the
memory is measured by ``tests/protocol/test_limits.py``):

- The payload is read from a file-like object in ``_READ_SIZE`` chunks. (``feed(payload)`` would
  copy the whole payload into the unpacker's buffer.)
- The top-level map is walked with ``read_map_header`` and ``skip`` only, which build nothing.
  ``skip`` ignores the ``max_*_len`` limits (they apply to built values only), so a declared
  length costs nothing until its bytes are there; but a str/bin being skipped must sit whole in
  the buffer: ``max_buffer_size`` caps that, and a longer one raises ``BufferFull``, which ends
  the walk with what was found before it. Nesting is bounded by the unpacker's fixed stack
  (``StackError``, also the end of the walk).
- The wanted values are not ``unpack``-ed from the stream: one unpacker has one set of limits
  (``meta`` needs the job's rules, ``id`` a few hundred bytes), and an ``unpack`` that fails on a
  limit leaves the unpacker in the middle of a value (it then reads garbage). Their byte spans
  (``tell``) are decoded afterwards, each under its own strict limits.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import msgpack

from worker.errors import ProtocolError
from worker.protocol.limits import DEFAULT_LIMITS, MAX_ID_CHARS, MAX_KEY_CHARS, Limits, unpack

#: Top-level keys ``peek_envelope`` reads, and the most wire bytes each value may take (meta:
#: ``Limits.max_meta_bytes``); a longer value is skipped unread.
_PEEK_BOUNDS: dict[str, int | None] = {
    "v": 9,
    "id": 3 + 4 * MAX_ID_CHARS,
    "reply_to": 3 + 4 * MAX_KEY_CHARS,
    "meta": None,
}
_MAX_KEY_BYTES = 16  # longer than any wanted key's encoding (str 32 header + "reply_to")
_MAX_PAIRS = 1024  # a valid job has < 10 top-level keys; ``unpack`` rejects maps above 1024
_READ_SIZE = 64 * 1024
_MIN_BUFFER = 1024 * 1024


def _top_level_spans(payload: bytes, max_buffer: int) -> dict[str, tuple[int, int]]:
    """Byte spans ``(start, end)`` of the values of the ``_PEEK_BOUNDS`` keys of a top-level map.

    The unpacker's buffer holds one read chunk or the single str/bin being skipped (at most
    ``max_buffer`` bytes), never a decoded tree (see the module docstring). Returns what was found
    before the payload ended or turned out to be garbage; the last occurrence of a duplicated key
    wins (as in ``decode_job``).
    """
    size = len(payload)
    read_size = max(1, min(size, _READ_SIZE))
    # read_map_header and skip build nothing: the max_*_len bounds are the bytes that are there.
    unpacker = msgpack.Unpacker(
        io.BytesIO(payload),
        read_size=read_size,
        max_buffer_size=max(min(size, max_buffer), read_size),
        max_str_len=size,
        max_bin_len=size,
        max_array_len=size,
        max_map_len=size,
        max_ext_len=size,
    )
    spans: dict[str, tuple[int, int]] = {}
    try:
        pairs = unpacker.read_map_header()
        for _ in range(min(pairs, _MAX_PAIRS)):
            key_start = unpacker.tell()
            unpacker.skip()
            value_start = unpacker.tell()
            unpacker.skip()
            if value_start - key_start > _MAX_KEY_BYTES:
                continue
            try:  # a few bytes: decoding them builds nothing big
                key = msgpack.unpackb(payload[key_start:value_start], raw=False)
            except Exception:  # not UTF-8, a bad ext, ...: not a key we want
                continue
            if isinstance(key, str) and key in _PEEK_BOUNDS:
                spans[key] = (value_start, unpacker.tell())
    except Exception:  # not a map, truncated, too big a str/bin, nested too deep: keep the rest
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


def _unpack_meta(data: memoryview, limits: Limits) -> Any:
    """Decode ``meta`` under the rules of ``decode_job`` within ``limits.max_meta_bytes`` wire
    bytes; raises ``ProtocolError`` when it breaks them."""
    bound = limits.max_meta_bytes
    if len(data) > bound:
        raise ProtocolError(f"meta is larger than {bound} bytes")
    meta_limits = Limits(
        max_payload_bytes=bound,
        max_seqs=limits.max_seqs,
        max_tokens=limits.max_tokens,
        max_meta_bytes=bound,
    )
    return unpack(data, meta_limits)


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
    max_buffer = max(limits.max_payload_bytes, _MIN_BUFFER)
    view = memoryview(payload)
    out: dict[str, Any] = {}
    for key, (start, end) in _top_level_spans(payload, max_buffer).items():
        bound = _PEEK_BOUNDS[key]
        if bound is None:  # meta
            with contextlib.suppress(ProtocolError):
                out["meta"] = _unpack_meta(view[start:end], limits)
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
