"""Protocol Buffers wire encoding, the few pieces a response needs (no protobuf dependency).

The wire format (https://protobuf.dev/programming-guides/encoding/): a message is a sequence of
fields, each a key ``(field_number << 3) | wire_type`` written as a varint, then the value:
wire type 0 (``VARINT``) for integers and enums, wire type 2 (``LEN``) for ``bytes``, strings,
embedded messages and packed repeated scalars (a varint length, then the bytes). Proto3 leaves
scalar fields at their default (0) out; ``scalar`` does the same, ``length_delimited`` always
writes its field (a message or a ``oneof`` member is present even when empty).

The naive equivalent is ``google.protobuf``'s ``SerializeToString`` on the generated class; the
tests parse what this writes with it.
"""

from __future__ import annotations

from collections.abc import Iterable

VARINT = 0
LEN = 2


def varint(value: int) -> bytes:
    """``value`` (>= 0, < 2**64) as a base-128 varint, least significant group first."""
    if value < 0:
        raise ValueError(f"varint of a negative value {value}: not used by these messages")
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def key(number: int, wire_type: int) -> bytes:
    """The key of field ``number``."""
    return varint((number << 3) | wire_type)


def scalar(number: int, value: int) -> bytes:
    """An integer or enum field (``uint32``, ``int64`` >= 0, enum); nothing when 0 (proto3)."""
    return key(number, VARINT) + varint(value) if value else b""


def length_delimited(number: int, data: bytes) -> bytes:
    """A ``bytes`` or embedded-message field, always written."""
    return key(number, LEN) + varint(len(data)) + data


def packed(number: int, values: Iterable[int]) -> bytes:
    """A packed ``repeated`` integer field (proto3's default for scalars); nothing when empty."""
    body = b"".join(varint(v) for v in values)
    return length_delimited(number, body) if body else b""
