"""``decode_job`` accepts exactly ``v: 1`` (an int); token-id lists take any integer scalar."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from worker import protocol
from worker.errors import BadRequest, ProtocolError

REPLY = "scoring:{q}:replies:c"


def _payload(**overrides: Any) -> bytes:
    body: dict[str, Any] = {
        "v": 1,
        "id": "j1",
        "mode": "reference",
        "reply_to": REPLY,
        "seqs": [{"tokens": [1, 2, 3], "prompt_len": 1}],
    }
    body.update(overrides)
    return msgpack.packb({k: v for k, v in body.items() if v is not ...}, use_bin_type=True)


def test_v1_int_is_accepted() -> None:
    job = protocol.decode_job(_payload())
    assert job.id == "j1" and list(job.seqs[0].tokens) == [1, 2, 3]


@pytest.mark.parametrize("v", [1.0, True, "1", b"\x01", None, 0, 2, -1, [1], {"v": 1}, ...])
def test_any_other_v_is_an_unsupported_version(v: Any) -> None:
    with pytest.raises(ProtocolError, match="unsupported protocol version") as info:
        protocol.decode_job(_payload(v=v))
    assert info.value.code == "bad_request"
    assert isinstance(info.value, BadRequest)


def test_float32_v_is_rejected_too() -> None:
    payload = msgpack.packb(
        {**msgpack.unpackb(_payload()), "v": 1.0}, use_single_float=True, use_bin_type=True
    )
    assert b"\xca" in payload  # float32 on the wire
    with pytest.raises(ProtocolError, match=r"unsupported protocol version 1\.0"):
        protocol.decode_job(payload)


def test_the_encoder_writes_an_int_v() -> None:
    spec = protocol.SeqSpec(tokens=protocol.as_int32_array([1, 2, 3]), prompt_len=1)
    body = msgpack.unpackb(protocol.encode_job("j", "reference", REPLY, [spec]))
    assert body["v"] == 1 and type(body["v"]) is int


# ----------------------------------------------------------------------------- token ids


def test_lists_of_integer_scalars_become_int32() -> None:
    values = [np.int8(1), np.uint32(2), np.int64(3), np.array(4), 5]
    assert list(protocol.as_int32_array(values)) == [1, 2, 3, 4, 5]
    assert list(protocol.as_int32_array(list(np.array([7, 8, 9])))) == [7, 8, 9]
    assert list(protocol.as_int32_array(tuple(np.arange(3)))) == [0, 1, 2]


def test_lists_of_torch_scalars_become_int32() -> None:
    torch = pytest.importorskip("torch")
    assert list(protocol.as_int32_array(list(torch.tensor([3, 4, 5])))) == [3, 4, 5]
    assert list(protocol.as_int32_array([torch.tensor(6, dtype=torch.int32), 7])) == [6, 7]
    with pytest.raises(ProtocolError, match="boolean"):
        protocol.as_int32_array([torch.tensor(True), 1])
    with pytest.raises(ProtocolError, match=r"token ids must be integers.*torch\.float32"):
        protocol.as_int32_array([torch.tensor(1.0), 1])
    with pytest.raises(ProtocolError, match="integer scalars"):
        protocol.as_int32_array([torch.tensor([1]), 2])


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, True], r"got a boolean \(bool\) at index 1"),
        ([np.bool_(False), 1], "got a boolean"),
        ([1.0, 2], "got float at index 0"),
        ([1, np.float32(2)], "got float32 at index 1"),
        ([1, "2"], "got str at index 1"),
        ([1, None], "got NoneType at index 1"),
        ([1, np.array([2])], "integer scalars"),
    ],
)
def test_non_integer_token_ids_are_rejected_clearly(tokens: list[Any], message: str) -> None:
    with pytest.raises(ProtocolError, match=message) as info:
        protocol.as_int32_array(tokens)
    assert info.value.code == "bad_request"


@pytest.mark.parametrize("big", [2**31, np.int64(2**31), np.uint32(2**32 - 1), -(2**31) - 1])
def test_int32_range_is_still_checked(big: Any) -> None:
    with pytest.raises(ProtocolError, match="outside int32"):
        protocol.as_int32_array([1, big])
    assert list(protocol.as_int32_array([np.int64(2**31 - 1), -(2**31)])) == [2**31 - 1, -(2**31)]


def test_wire_token_arrays_reject_booleans_and_floats() -> None:
    for bad, message in (([1, True, 3], "boolean"), ([1, 2.0, 3], "float")):
        payload = _payload(seqs=[{"tokens": bad, "prompt_len": 1}])
        with pytest.raises(ProtocolError, match=rf"seqs\[0\]\.tokens: .*{message}"):
            protocol.decode_job(payload)
