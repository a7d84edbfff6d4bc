"""The ``hidden`` output on the wire: its job keys round-trip, bad values are refused where the
request is built, the ``bf16`` result dtype carries bfloat16 bits that the client upcasts
exactly, and a result's size counts ``H`` bytes per row."""

from __future__ import annotations

import numpy as np
import pytest

from worker.client.results import ScoreResult
from worker.errors import BadRequest, ProtocolError, TooLarge
from worker.protocol import Result, SeqResult, decode_result, encode_result
from worker.protocol.outputs import decode_output_request, encode_output_request
from worker.request import TokenOutputs
from worker.scorer.teacher import array_layout, check_limits, result_bytes


def test_hidden_job_keys_round_trip_and_bad_values_are_refused() -> None:
    spec = TokenOutputs(("logps", "hidden"), hidden_dtype="float16", max_result_bytes=10_000)
    body = encode_output_request(spec)
    assert body == {
        "outputs": ["hidden", "logps"], "hidden_dtype": "float16", "max_result_bytes": 10_000
    }  # fmt: skip
    assert decode_output_request(body, "reference") == spec
    assert TokenOutputs(("hidden",)).hidden_dtype == "bfloat16"
    with pytest.raises(BadRequest, match="hidden_dtype must be one of"):
        TokenOutputs(("hidden",), hidden_dtype="int8")
    with pytest.raises(BadRequest, match="'hidden' is not a requested output"):
        TokenOutputs(("logps",), hidden_dtype="float32")
    with pytest.raises(ProtocolError, match="max_result_bytes must be an integer"):
        decode_output_request({"outputs": ["hidden"], "max_result_bytes": "1"}, "reference")


def test_sizes_and_limits_count_the_rows() -> None:
    spec = TokenOutputs(("logps", "hidden"))
    assert result_bytes(10, spec, hidden_size=64) == 10 * (4 + 64 * 2)
    f32 = TokenOutputs(("hidden",), hidden_dtype="float32")
    assert result_bytes(10, f32, hidden_size=64) == 10 * 64 * 4
    assert array_layout(spec, 64) == {"logps": ("<f4", 1), "hidden": ("bf16", 64)}
    check_limits(spec, 10, max_topk=256, max_bytes=1320, hidden_size=64)
    with pytest.raises(TooLarge, match=r"would be 1320 bytes .* limit of 1319 bytes"):
        check_limits(spec, 10, max_topk=256, max_bytes=1319, hidden_size=64)
    own = TokenOutputs(("logps", "hidden"), max_result_bytes=100)
    with pytest.raises(TooLarge, match="the job's max_result_bytes of 100 bytes"):
        check_limits(own, 10, max_topk=256, max_bytes=10**9, hidden_size=64)
    with pytest.raises(BadRequest, match="serves no 'hidden' rows"):
        check_limits(spec, 10, max_topk=256, max_bytes=10**9, hidden_size=0)


def test_bf16_rows_travel_as_bits_and_come_back_as_their_exact_float32() -> None:
    """... and as those bits (``hidden_bits``, what ``worker.tensors`` makes a bfloat16 tensor
    of); float16 rows come as they travelled, with no bits beside them."""
    rows = np.array([[1.0, -2.5, 3.140625], [0.0, 0.0009765625, -65280.0]], np.float32)
    bits = (rows.view(np.uint32) >> 16).astype(np.uint16)  # exact: all are bfloat16 values
    result = Result(
        id="j", ok=True, seqs=[SeqResult(arrays={"hidden": bits})], layout={"hidden": ("bf16", 3)}
    )
    wire = decode_result(encode_result(result))
    assert wire.layout == {"hidden": ("bf16", 3)} and wire.seqs[0].arrays is not None
    assert wire.seqs[0].arrays["hidden"] == bits.tobytes()
    got = ScoreResult.from_wire(wire)[0]
    assert got.hidden_dtype == "bfloat16" and got.hidden.dtype == np.float32
    np.testing.assert_array_equal(got.hidden, rows)
    assert got.hidden_bits.dtype == np.uint16 and got.hidden_bits.shape == (2, 3)
    np.testing.assert_array_equal(got.hidden_bits, bits)  # the bits as they travelled
    assert got.to_json()["hidden_dtype"] == "bfloat16"
    half = ScoreResult.from_wire(
        Result(id="j", ok=True, seqs=[SeqResult(arrays={"hidden": rows.astype(np.float16)})],
               layout={"hidden": ("<f2", 3)})
    )[0]  # fmt: skip
    assert half.hidden.dtype == np.float16 and half.hidden_bits is None
