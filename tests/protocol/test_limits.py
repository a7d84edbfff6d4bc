"""The decoding rules and limits of docs/protocol.md ("Decoding rules", "Limits"), pinned one by
one, and ``peek_envelope`` on payloads that break them (it must still find the reply address)."""

from __future__ import annotations

import datetime
import struct
import time
import tracemalloc
from typing import Any

import msgpack
import pytest

from worker import protocol
from worker.errors import ProtocolError
from worker.protocol import Limits

REPLY = "scoring:{q}:replies:c1"


def _tokens(n: int) -> bytes:
    return struct.pack(f"<{n}i", *([1] * n))


def _body(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "v": 1,
        "id": "job-1",
        "mode": "reference",
        "reply_to": REPLY,
        "seqs": [{"tokens": _tokens(4), "prompt_len": 2}],
    }
    body.update(over)
    return body


def _pack(body: Any, **kwargs: Any) -> bytes:
    kwargs.setdefault("use_bin_type", True)
    return msgpack.packb(body, **kwargs)


def _bad(payload: bytes, needle: str, limits: Limits = protocol.DEFAULT_LIMITS) -> str:
    """Assert ``decode_job`` rejects with bad_request matching ``needle``, and that the envelope
    is still readable (so the daemon answers instead of dead-lettering)."""
    with pytest.raises(ProtocolError, match=needle) as info:
        protocol.decode_job(payload, limits)
    assert info.value.code == "bad_request"
    env = protocol.peek_envelope(payload, limits)
    assert env.get("id") == "job-1" and env.get("reply_to") == REPLY, env
    return info.value.message


# ----------------------------------------------------------------------------- decoding rules


@pytest.mark.parametrize(
    "meta",
    [{1: "a"}, {"outer": {2: "b"}}, [{None: 1}], {(1, 2): 3}, {1.5: 0}],
    ids=["int-key", "nested-int-key", "nil-key-in-array", "array-key", "float-key"],
)
def test_meta_maps_need_str_or_bin_keys(meta: Any) -> None:
    message = _bad(_pack(_body(meta=meta)), "map keys must be str or bin")
    assert "meta" in message
    assert "meta" not in protocol.peek_envelope(_pack(_body(meta=meta)))


def test_bin_map_keys_are_accepted_and_echoed() -> None:
    job = protocol.decode_job(_pack(_body(meta={b"k": 1, "s": 2})))
    assert job.meta == {b"k": 1, "s": 2}
    out = protocol.decode_result(
        protocol.encode_result(protocol.Result(id="j", ok=True, meta=job.meta))
    )
    assert out.meta == {b"k": 1, "s": 2}


@pytest.mark.parametrize(
    "meta",
    [
        msgpack.ExtType(5, b"xy"),
        msgpack.Timestamp(1),  # timestamp 32
        datetime.datetime(2024, 1, 2, tzinfo=datetime.UTC),  # packed as timestamp
        {"when": msgpack.Timestamp(1, 5)},  # timestamp 64, nested
    ],
    ids=["ext", "timestamp32", "datetime", "nested-timestamp64"],
)
def test_ext_types_and_timestamps_are_rejected(meta: Any) -> None:
    payload = _pack(_body(meta=meta), datetime=True)
    _bad(payload, "ext types")
    assert "meta" not in protocol.peek_envelope(payload)


def test_rules_apply_to_unknown_keys_too() -> None:
    _bad(_pack(_body(extra=msgpack.ExtType(1, b"x"))), "ext types")
    _bad(_pack(_body(extra={7: 7})), "map keys")
    assert protocol.decode_job(_pack(_body(extra={"fine": [1, 2.5, None]}))).id == "job-1"


def test_strings_must_be_valid_utf8() -> None:
    raw = bytearray(_pack(_body(meta="\u00e9t\u00e9")))
    at = raw.index("\u00e9t\u00e9".encode())
    raw[at] = 0xFF  # break the UTF-8 of meta
    _bad(bytes(raw), "valid UTF-8")


def test_strings_longer_than_max_meta_bytes_are_rejected_anywhere() -> None:
    limits = Limits(max_meta_bytes=256)
    _bad(_pack(_body(note="x" * 257)), "a str is longer than 256 bytes", limits)
    _bad(_pack(_body(mode="m" * 300)), "a str is longer than 256 bytes", limits)
    assert protocol.decode_job(_pack(_body(note="x" * 256)), limits).id == "job-1"


@pytest.mark.parametrize(
    "tokens, needle",
    [
        (_tokens(4), "tokens must be int32 bin"),  # valid UTF-8 bytes, decoded as str
        (struct.pack("<4i", 1, 2, 3, 255), "valid UTF-8"),  # 0xff: not UTF-8 at all
    ],
    ids=["raw-utf8", "raw-not-utf8"],
)
def test_tokens_in_the_old_raw_encoding_are_rejected(tokens: bytes, needle: str) -> None:
    payload = _pack(_body(seqs=[{"tokens": tokens, "prompt_len": 2}]), use_bin_type=False)
    assert b"\xc4" not in payload  # no bin type: bytes went out as raw (str)
    message = _bad(payload, needle)
    assert "bin" in message


def test_tokens_as_bin_or_int_array_only() -> None:
    for tokens in ("abcd", 5, [1.0, 2.0], None):
        _bad(_pack(_body(seqs=[{"tokens": tokens, "prompt_len": 1}])), "tokens")


def test_float32_meta_comes_back_as_float64() -> None:
    payload = _pack(_body(meta={"x": 0.5, "y": [1.25]}), use_single_float=True)
    assert b"\xca" in payload and b"\xcb" not in payload
    job = protocol.decode_job(payload)
    assert job.meta == {"x": 0.5, "y": [1.25]}
    out = protocol.encode_result(protocol.Result(id="j", ok=True, meta=job.meta))
    assert b"\xcb\x3f\xe0\x00\x00\x00\x00\x00\x00" in out and b"\xca" not in out


def test_meta_size_is_its_reencoded_size_and_nil_means_absent() -> None:
    limits = Limits(max_meta_bytes=64)
    _bad(_pack(_body(meta=list(range(100)))), "meta is larger than 64 bytes", limits)
    # 12 float32 (5 bytes each) fit on the wire but re-encode as float64 (9 bytes each).
    floats = _pack(_body(meta=[0.5] * 12), use_single_float=True)
    _bad(floats, "meta is larger than 64 bytes", limits)
    assert protocol.decode_job(_pack(_body(meta=None))).meta is None


def test_nesting_and_map_size_bounds() -> None:
    flat = _pack(_body(meta=0))
    assert flat.endswith(b"\xa4meta\x00")
    _bad(flat[:-1] + b"\x91" * 1100 + b"\x00", "nested too deep")  # meta: 1100 nested arrays
    wide = {f"k{i}": i for i in range(1025)}
    _bad(_pack(_body(meta=wide)), "1025 exceeds max_map_len")


# ----------------------------------------------------------------------------- limits


def test_every_limit_rejects_with_bad_request() -> None:
    limits = Limits(max_payload_bytes=2048, max_seqs=2, max_tokens=10, max_meta_bytes=128)
    _bad(_pack(_body(pad=b"x" * 2048)), "payload is 2.* bytes, over the limit of 2048", limits)
    _bad(_pack(_body(seqs=[{"tokens": _tokens(2), "prompt_len": 1}] * 3)), "3 sequences", limits)
    _bad(_pack(_body(seqs=[{"tokens": _tokens(11), "prompt_len": 1}])), "10 tokens", limits)
    _bad(_pack(_body(meta="m" * 127)), "meta is larger than 128", limits)
    # Fixed bounds (not configurable); such a job cannot be addressed by that field.
    with pytest.raises(ProtocolError, match="id must be a non-empty string of at most 128"):
        protocol.decode_job(_pack(_body(id="x" * 129)))
    with pytest.raises(ProtocolError, match="reply_to must be a non-empty string"):
        protocol.decode_job(_pack(_body(reply_to="r" * 513)))


# ----------------------------------------------------------------------------- peek_envelope


def test_peek_reads_the_envelope_of_an_oversized_payload() -> None:
    limits = Limits(max_payload_bytes=4096)
    payload = protocol.encode_job(
        "job-1", "reference", REPLY, [{"tokens": [1] * 5000, "prompt_len": 1}], meta={"k": 1}
    )
    assert len(payload) > 4096
    env = protocol.peek_envelope(payload, limits)
    assert env == {"v": 1, "id": "job-1", "reply_to": REPLY, "meta": {"k": 1}}
    _bad(payload, "over the limit of 4096", limits)


def test_peek_finds_keys_in_any_order_and_the_last_duplicate_wins() -> None:
    limits = Limits(max_payload_bytes=1024)
    big = [{"tokens": _tokens(1000), "prompt_len": 1}]
    body = {"seqs": big, "meta": "m", "reply_to": REPLY, "id": "job-1", "v": 1}
    assert protocol.peek_envelope(_pack(body), limits) == {
        "v": 1,
        "id": "job-1",
        "reply_to": REPLY,
        "meta": "m",
    }
    # Two "id" pairs (hand-written map): the decoder's dict keeps the last, so does peek.
    dup = b"\x83" + _pack("id") + _pack("first") + _pack("reply_to") + _pack(REPLY)
    dup += _pack("id") + _pack("second")
    assert protocol.peek_envelope(dup)["id"] == "second"
    assert msgpack.unpackb(dup)["id"] == "second"


def test_peek_keeps_what_it_can_read() -> None:
    # Bad or oversized values are left out, the rest is kept.
    for over in (
        {"id": "x" * 129},
        {"id": 5},
        {"id": "x" * 1_000_000},
        {"id": b"job-1"},
    ):
        env = protocol.peek_envelope(_pack(_body(**over)))
        assert "id" not in env and env["reply_to"] == REPLY
    env = protocol.peek_envelope(_pack(_body(meta="m" * 200)), Limits(max_meta_bytes=128))
    assert "meta" not in env and env["id"] == "job-1"
    # Truncated after the address: what came before is still read.
    payload = _pack(_body())
    cut = payload[: payload.index(b"\xa4seqs") + 6]
    assert protocol.peek_envelope(cut) == {"v": 1, "id": "job-1", "reply_to": REPLY}
    # Not bytes, empty, not a map, garbage, a str key that is not UTF-8.
    for junk in (
        None,
        "text",
        b"",
        b"\xc1",
        _pack([1, 2]),
        b"\x91" * 5000,
        b"\x81\xa2\xff\xfe\x01",
    ):
        assert protocol.peek_envelope(junk) == {}  # type: ignore[arg-type]
    assert protocol.peek_envelope(bytearray(payload))["id"] == "job-1"
    assert protocol.peek_envelope(memoryview(payload))["id"] == "job-1"


def test_peek_memory_is_bounded_by_one_buffer() -> None:
    """Many small values: the walk allocates about one read chunk. One str/bin bigger than
    max(max_payload_bytes, 1 MiB): the walk stops there, keeping what came before it."""
    limits = Limits(max_payload_bytes=4096)
    many = _pack(_body(seqs=[{"tokens": _tokens(8), "prompt_len": 1}] * 200_000, meta="m"))
    huge_leaf = _pack(
        {"id": "job-1", "reply_to": REPLY, "seqs": [{"tokens": b"\x00" * (8 << 20)}], "meta": "m"}
    )
    for payload, expected, max_peak in (
        (many, {"v": 1, "id": "job-1", "reply_to": REPLY, "meta": "m"}, 512 * 1024),
        (huge_leaf, {"id": "job-1", "reply_to": REPLY}, 3 * 1024 * 1024),
    ):
        tracemalloc.start()
        t0 = time.perf_counter()
        try:
            env = protocol.peek_envelope(payload, limits)
            elapsed = time.perf_counter() - t0
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert env == expected
        assert peak < max_peak, f"peak {peak} bytes for a {len(payload)}-byte payload"
        assert elapsed < 5.0
    # With the payload limit above the leaf, the walk gets past it.
    assert protocol.peek_envelope(huge_leaf, Limits(max_payload_bytes=16 << 20))["meta"] == "m"


def test_peek_stops_at_deep_nesting_or_a_missing_value_keeping_what_came_before() -> None:
    """The walk skips values with msgpack's Unpacker: nesting deeper than its stack, or a
    declared length the payload does not hold, ends it without allocating what was declared."""
    head = b"\x83" + _pack("id") + _pack("job-1") + _pack("reply_to") + _pack(REPLY)
    deep = head + _pack("meta") + b"\x91" * 100_000 + b"\xc0"
    declared = [
        head + _pack("seqs") + b"\xc6\xff\xff\xff\xff",  # bin 32 of 4 GiB
        head + _pack("seqs") + b"\xdd\xff\xff\xff\xff",  # array 32 of 4 G entries
        head + _pack("meta") + b"\xdf\xff\xff\xff\xff",  # map 32 of 4 G pairs
    ]
    for payload in (deep, *declared):
        tracemalloc.start()
        try:
            env = protocol.peek_envelope(payload)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert env == {"id": "job-1", "reply_to": REPLY}
        assert peak < 512 * 1024, f"peak {peak} bytes"
    # A key in a longer str encoding (str 8) is still that key.
    str8 = b"\x81\xd9\x02id" + _pack("job-2")
    assert protocol.peek_envelope(str8) == {"id": "job-2"}
    # Keys that are not str (bin, int) are not the envelope's, as in decode_job.
    assert protocol.peek_envelope(_pack({b"id": "x", 1: "y", "reply_to": REPLY})) == {
        "reply_to": REPLY
    }
