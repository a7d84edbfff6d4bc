"""Wire protocol v1: round trips, strictness and bounds."""

from __future__ import annotations

import struct
from array import array

import msgpack
import pytest

from worker import protocol
from worker.errors import ProtocolError
from worker.protocol import Limits, Result, SeqResult


def _job(**over):
    body = {
        "v": 1,
        "id": "job-1",
        "mode": "reference",
        "reply_to": "scoring:{q}:replies:c1",
        "seqs": [{"tokens": struct.pack("<4i", 1, 2, 3, 4), "prompt_len": 2}],
    }
    body.update(over)
    return msgpack.packb(body, use_bin_type=True)


def test_encode_decode_round_trip_with_mask_and_meta() -> None:
    payload = protocol.encode_job(
        "j",
        "both",
        "r",
        [{"tokens": [5, 6, 7], "mask": [0, 1, 1]}, {"tokens": [1, 2], "prompt_len": 1}],
        temperature=0.7,
        deadline_ms=123,
        meta={"step": 3},
    )
    job = protocol.decode_job(payload)
    assert job.id == "j" and job.mode == "both" and job.temperature == pytest.approx(0.7)
    assert list(job.seqs[0].tokens) == [5, 6, 7] and job.seqs[0].mask == b"\x00\x01\x01"
    assert job.seqs[1].prompt_len == 1 and job.deadline_ms == 123 and job.meta == {"step": 3}
    assert job.num_tokens == 5 and job.seqs[0].num_scored == 2


def test_tokens_are_little_endian_int32_bin() -> None:
    payload = protocol.encode_job("j", "reference", "r", [{"tokens": [1, 256], "prompt_len": 1}])
    raw = msgpack.unpackb(payload)
    assert raw["seqs"][0]["tokens"] == b"\x01\x00\x00\x00\x00\x01\x00\x00"


def test_tokens_as_int_array_accepted_and_unknown_fields_ignored() -> None:
    job = protocol.decode_job(_job(seqs=[{"tokens": [1, 2, 3], "prompt_len": 1, "x": 1}], extra=5))
    assert list(job.seqs[0].tokens) == [1, 2, 3]


@pytest.mark.parametrize(
    "over, needle",
    [
        ({"v": 2}, "version"),
        ({"id": ""}, "id"),
        ({"id": "x" * 129}, "id"),
        ({"reply_to": 5}, "reply_to"),
        ({"seqs": []}, "seqs"),
        ({"seqs": [{"tokens": b"\x01\x02\x03", "prompt_len": 1}]}, "multiple of 4"),
        ({"seqs": [{"tokens": [1, 2, 3]}]}, "exactly one"),
        ({"seqs": [{"tokens": [1, 2, 3], "prompt_len": 3}]}, "prompt_len"),
        ({"seqs": [{"tokens": [1, 2, 3], "prompt_len": 0}]}, "prompt_len"),
        ({"seqs": [{"tokens": [1, 2, 3], "mask": b"\x01\x01\x01"}]}, r"mask\[0\]"),
        ({"seqs": [{"tokens": [1, 2, 3], "mask": b"\x00\x00\x00"}]}, "no token"),
        ({"seqs": [{"tokens": [1, 2, 3], "mask": b"\x00\x01"}]}, "entries"),
        ({"seqs": [{"tokens": [1, 2, 3], "mask": b"\x00\x02\x01"}]}, "0 or 1"),
        ({"seqs": [{"tokens": [1, "a"], "prompt_len": 1}]}, "integers"),
        ({"seqs": [{"tokens": [1, 2**40], "prompt_len": 1}]}, "int32"),
        ({"temperature": 0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"deadline_ms": "soon"}, "deadline_ms"),
    ],
)
def test_schema_violations_are_bad_request(over: dict, needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle) as info:
        protocol.decode_job(_job(**over))
    assert info.value.code == "bad_request"


def test_garbage_and_non_map_payloads() -> None:
    for payload in (b"\xc1", b"", msgpack.packb([1, 2]), b"\x92\x01"):
        with pytest.raises(ProtocolError):
            protocol.decode_job(payload)


def test_bounds_are_enforced_before_allocation() -> None:
    limits = Limits(max_payload_bytes=1000, max_seqs=2, max_tokens=10)
    with pytest.raises(ProtocolError, match="over the limit"):
        protocol.decode_job(b"\x00" * 1001, limits)
    with pytest.raises(ProtocolError, match="sequences"):
        protocol.decode_job(_job(seqs=[{"tokens": [1, 2], "prompt_len": 1}] * 3), limits)
    with pytest.raises(ProtocolError, match=r"tokens|max_array_len"):
        protocol.decode_job(_job(seqs=[{"tokens": list(range(11)), "prompt_len": 1}]), limits)
    # A header claiming a 4 GiB bin must not allocate it.
    with pytest.raises(ProtocolError):
        protocol.decode_job(b"\xc6\xff\xff\xff\xff", limits)


def test_peek_envelope_reads_reply_address_of_invalid_job() -> None:
    env = protocol.peek_envelope(_job(v=9, meta=[1]))
    assert env == {"v": 9, "id": "job-1", "reply_to": "scoring:{q}:replies:c1", "meta": [1]}
    assert protocol.peek_envelope(b"garbage") == {}


def test_result_round_trip_ok_and_error() -> None:
    res = Result(
        id="j",
        ok=True,
        seqs=[SeqResult(logps=array("f", [-1.5, -0.25]), reward=0.5)],
        meta={"a": 1},
        info={"backend": "sdpa"},
    )
    out = protocol.decode_result(protocol.encode_result(res))
    assert out.ok and list(out.seqs[0].logps) == [-1.5, -0.25] and out.seqs[0].reward == 0.5
    assert out.meta == {"a": 1} and out.info["backend"] == "sdpa"
    err = protocol.decode_result(
        protocol.encode_result(protocol.error_result("j", "too_long", "x"))
    )
    assert not err.ok and err.code == "too_long" and err.error["message"] == "x"
    with pytest.raises(ValueError):
        protocol.encode_result(protocol.error_result("j", "nope", "x"))


def test_numpy_tokens_and_masks_are_accepted() -> None:
    np = pytest.importorskip("numpy")
    payload = protocol.encode_job(
        "j",
        "reference",
        "r",
        [{"tokens": np.arange(4, dtype=np.int64), "mask": np.array([0, 1, 0, 1])}],
    )
    job = protocol.decode_job(payload)
    assert list(job.seqs[0].tokens) == [0, 1, 2, 3] and job.seqs[0].mask == b"\x00\x01\x00\x01"
    with pytest.raises(ProtocolError, match="integers"):
        protocol.encode_job("j", "reference", "r", [{"tokens": np.ones(3), "prompt_len": 1}])
