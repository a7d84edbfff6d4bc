"""Wire constants, the decoding :class:`Limits`, and the one bounded msgpack decoder.

Every payload a worker or producer decodes goes through :func:`unpack`: each size is checked
against ``Limits`` before anything proportional to it is allocated, and pickle is never involved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from worker.errors import ProtocolError

PROTOCOL_VERSION = 1
PAYLOAD_FIELD = b"payload"
MAX_ID_CHARS = 128
MAX_KEY_CHARS = 512


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


def unpack(payload: bytes | memoryview, limits: Limits) -> Any:
    """msgpack-decode with every container and string bounded by ``limits``.

    Raises ``ProtocolError`` (keeping the first 256 bytes) for anything that is not valid msgpack
    within the limits, with the protocol rule it breaks when that is known.
    """
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
