"""Property-based fuzz of the wire-protocol decoders (hypothesis).

Whatever bytes arrive, ``decode_job`` returns a schema-valid ``Job`` or raises ``ProtocolError``
(never another exception), returns quickly, and allocates memory bounded by the payload size, not
by the sizes that the payload's headers claim. ``decode_result`` (producers) and ``peek_envelope``
(error addressing: never raises, agrees with ``decode_job``, reads oversized payloads) get the
same treatment.

CI runs a bounded number of examples per property under the derandomized hypothesis profile
"ci" (``tests/conftest.py``: the same examples every run); local runs explore new ones each
time. For a long run::

    HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest tests/protocol/test_fuzz.py
    SCORING_FUZZ_EXAMPLES=50000 .venv/bin/python -m pytest tests/protocol/test_fuzz.py
"""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import time
import tracemalloc
from array import array
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from worker import protocol
from worker.errors import ProtocolError
from worker.protocol import MAX_ID_CHARS, MAX_KEY_CHARS, MODES, Job, Limits, Result

_DEFAULT_EXAMPLES = 20_000 if os.environ.get("HYPOTHESIS_PROFILE") == "long" else 300
EXAMPLES = int(os.environ.get("SCORING_FUZZ_EXAMPLES", _DEFAULT_EXAMPLES))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SMALL = Limits(max_payload_bytes=8192, max_seqs=8, max_tokens=256, max_meta_bytes=512)
LIMITS = [protocol.DEFAULT_LIMITS, SMALL]

pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------------------- checkers


def _assert_valid_job(job: Job, limits: Limits) -> None:
    """Every invariant a decoded job promises to the daemon."""
    assert isinstance(job, Job)
    assert isinstance(job.id, str) and 0 < len(job.id) <= MAX_ID_CHARS
    assert isinstance(job.reply_to, str) and 0 < len(job.reply_to) <= MAX_KEY_CHARS
    assert isinstance(job.mode, str)
    assert isinstance(job.temperature, float)
    assert math.isfinite(job.temperature) and job.temperature > 0
    assert job.deadline_ms is None or (
        isinstance(job.deadline_ms, int) and not isinstance(job.deadline_ms, bool)
    )
    assert isinstance(job.seqs, tuple) and 0 < len(job.seqs) <= limits.max_seqs
    assert job.num_tokens <= limits.max_tokens
    if job.meta is not None:
        assert len(msgpack.packb(job.meta, use_bin_type=True)) <= limits.max_meta_bytes
    for s in job.seqs:
        assert isinstance(s.tokens, array) and s.tokens.typecode == "i"
        n = len(s.tokens)
        if s.text is not None:  # text in: a non-empty str the worker tokenizes
            assert isinstance(s.text, str) and s.text and s.messages is None
            assert job.mode in ("reward", "both")
        if n == 0:  # a text-only (or messages-only) reward sequence: nothing else on it
            assert job.mode == "reward" and (s.text is not None or s.messages is not None)
            assert s.prompt_len is None and s.mask is None
            continue
        assert n >= 2
        assert (s.prompt_len is None) != (s.mask is None)
        if s.prompt_len is not None:
            assert isinstance(s.prompt_len, int) and not isinstance(s.prompt_len, bool)
            assert 1 <= s.prompt_len < n
        else:
            assert isinstance(s.mask, bytes) and len(s.mask) == n
            assert set(s.mask) <= {0, 1} and s.mask[0] == 0 and 1 in s.mask
        assert s.num_scored >= 1


def _decode_job_or_protocol_error(payload: bytes, limits: Limits) -> Job | None:
    """Decode; a ``ProtocolError`` is fine (returns None), anything else fails the test."""
    try:
        job = protocol.decode_job(payload, limits)
    except ProtocolError as exc:
        assert exc.code == "bad_request"
        assert exc.raw is None or len(exc.raw) <= 256
        return None
    _assert_valid_job(job, limits)
    return job


def _decode_result_or_protocol_error(payload: bytes) -> Result | None:
    try:
        res = protocol.decode_result(payload)
    except ProtocolError:
        return None
    assert isinstance(res, Result) and isinstance(res.id, str)
    assert isinstance(res.info, dict)
    if res.ok:
        assert res.error is None
    else:
        assert isinstance(res.code, str)  # a client can always read the code
    for s in res.seqs:
        assert s.logps is None or s.logps.typecode == "f"
        assert s.reward is None or isinstance(s.reward, (int, float))
    return res


def _check_envelope(payload: bytes, limits: Limits, job: Job | None) -> None:
    """``peek_envelope`` never raises, returns well-typed fields, and agrees with ``decode_job``
    on every job that decodes."""
    env = protocol.peek_envelope(payload, limits)
    assert isinstance(env, dict) and set(env) <= {"v", "id", "reply_to", "meta"}
    if "v" in env:
        assert isinstance(env["v"], int) and not isinstance(env["v"], bool)
    if "id" in env:
        assert isinstance(env["id"], str) and 0 < len(env["id"]) <= MAX_ID_CHARS
    if "reply_to" in env:
        assert isinstance(env["reply_to"], str) and 0 < len(env["reply_to"]) <= MAX_KEY_CHARS
    if "meta" in env:
        assert len(msgpack.packb(env["meta"], use_bin_type=True)) <= 2 * limits.max_meta_bytes
    if job is not None:
        assert env.get("v", 1) == 1  # (decode_job also takes 1.0 and true, which peek omits)
        assert env["id"] == job.id and env["reply_to"] == job.reply_to
        if "meta" in env:
            assert msgpack.packb(env["meta"]) == msgpack.packb(job.meta)


def _check_all(payload: bytes) -> None:
    for limits in LIMITS:
        job = _decode_job_or_protocol_error(payload, limits)
        _check_envelope(payload, limits, job)
    _decode_result_or_protocol_error(payload)


def same_value(a: Any, b: Any) -> bool:
    """``a == b`` for decoded msgpack trees, except that NaN equals NaN (at any depth): the
    wire echoes a NaN faithfully, but ``nan == nan`` is False."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(same_value(x, y) for x, y in zip(a, b, strict=True))
        )
    return type(a) is type(b) and a == b


def test_same_value_treats_nan_as_equal_and_nothing_else() -> None:
    nan = float("nan")
    echoed = {"": float("nan")}  # another NaN object, as the decoder returns
    assert {"": nan} != echoed and same_value({"": nan}, echoed)
    assert same_value([1, {"a": [nan, b"x"]}], [1, {"a": [nan, b"x"]}])
    assert not same_value({"": nan}, {"": 0.0})
    assert not same_value({"": 1.0}, {"": nan})
    assert not same_value({"a": 1}, {"b": 1})
    assert not same_value([1, 2], [1, 2, 3])
    assert not same_value(1, True) and not same_value(1, 1.0) and not same_value("a", b"a")


# ----------------------------------------------------------------------------- strategies

_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=64)
)
msgpack_trees = st.recursive(
    _leaf,
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=12), children, max_size=6)
    ),
    max_leaves=40,
)

_KEYS = ["v", "id", "mode", "reply_to", "seqs", "temperature", "deadline_ms", "meta"]
_SEQ_KEYS = ["tokens", "prompt_len", "mask"]


@st.composite
def token_values(draw: st.DrawFn) -> Any:
    """Tokens as the wire allows (int32 LE bin, int array) and as it does not."""
    ints = st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=12)
    return draw(
        ints.map(lambda xs: struct.pack(f"<{len(xs)}i", *xs))
        | ints
        | st.binary(max_size=30)
        | st.lists(_leaf, max_size=6)
        | _leaf
    )


@st.composite
def near_valid_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A job map whose fields are each valid, borderline or wrong: reaches deep decoder paths."""
    body: dict[str, Any] = {
        "v": draw(st.sampled_from([1, 1, 1, 1.0, 2, 0, "1", None, True])),
        "id": draw(st.text(min_size=0, max_size=MAX_ID_CHARS + 2) | _leaf),
        "mode": draw(st.sampled_from([*MODES, "", "x"]) | _leaf),
        "reply_to": draw(st.text(min_size=0, max_size=20) | _leaf),
        "temperature": draw(
            st.floats(allow_nan=True, allow_infinity=True)
            | st.integers(min_value=-3, max_value=2**64 - 1)
            | _leaf
        ),
        "deadline_ms": draw(st.none() | st.integers(min_value=-(2**63), max_value=2**64 - 1)),
        "meta": draw(msgpack_trees),
    }
    seqs = []
    for _ in range(draw(st.integers(0, 4))):
        tokens = draw(token_values())
        seq: dict[str, Any] = {"tokens": tokens}
        if draw(st.integers(0, 4)) == 0:  # text in, with or without tokens (or broken)
            seq["text"] = draw(st.text(max_size=20) | _leaf)
            if draw(st.booleans()):
                del seq["tokens"]
        choice = draw(st.integers(0, 3))
        if choice in (0, 2):
            seq["prompt_len"] = draw(st.integers(min_value=-2, max_value=16) | _leaf)
        if choice in (1, 2):
            seq["mask"] = draw(
                st.binary(max_size=16)
                | st.lists(st.integers(min_value=-1, max_value=300), max_size=16)
                | _leaf
            )
        seqs.append(seq)
    body["seqs"] = draw(st.just(seqs) | _leaf)
    drop = draw(st.sets(st.sampled_from(_KEYS), max_size=2))
    return {k: v for k, v in body.items() if k not in drop}


@st.composite
def valid_jobs(draw: st.DrawFn) -> tuple[bytes, dict[str, Any]]:
    """A valid payload (from ``encode_job``) and the fields it was built from."""
    seqs: list[dict[str, Any]] = []
    mode = draw(st.sampled_from(MODES))
    for _ in range(draw(st.integers(1, 4))):
        tokens = draw(
            st.lists(st.integers(min_value=0, max_value=2**31 - 1), min_size=2, max_size=24)
        )
        text = draw(st.none() | st.text(min_size=1, max_size=40)) if mode != "reference" else None
        if text is not None and mode == "reward" and draw(st.booleans()):
            seqs.append({"text": text})  # text in: the worker tokenizes it
            continue
        if draw(st.booleans()):
            seqs.append({"tokens": tokens, "prompt_len": draw(st.integers(1, len(tokens) - 1))})
        else:
            rest = draw(st.lists(st.integers(0, 1), min_size=len(tokens) - 1, max_size=len(tokens)))
            mask = [0, *rest[: len(tokens) - 1]]
            if 1 not in mask:
                mask[-1] = 1
            seqs.append({"tokens": tokens, "mask": mask})
        if text is not None:
            seqs[-1]["text"] = text
    fields = {
        "job_id": draw(st.text(min_size=1, max_size=MAX_ID_CHARS)),
        "mode": mode,
        "reply_to": draw(st.text(min_size=1, max_size=64)),
        "seqs": seqs,
        "temperature": draw(st.floats(min_value=1e-3, max_value=100.0)),
        "deadline_ms": draw(st.none() | st.integers(0, 2**62)),
        "meta": draw(st.none() | st.dictionaries(st.text(max_size=8), _leaf, max_size=4)),
    }
    payload = protocol.encode_job(
        fields["job_id"],
        fields["mode"],
        fields["reply_to"],
        seqs,
        temperature=fields["temperature"],
        deadline_ms=fields["deadline_ms"],
        meta=fields["meta"],
    )
    return payload, fields


@st.composite
def mutated_payloads(draw: st.DrawFn) -> bytes:
    """A valid payload with byte flips, insertions, deletions, truncation or a spliced header."""
    payload, _ = draw(valid_jobs())
    data = bytearray(payload)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.integers(0, 4))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == 0 and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == 1:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == 2 and data:
            del data[pos : pos + draw(st.integers(1, 8))]
        elif op == 3:
            data = data[:pos]
        else:  # a header claiming a huge container or blob
            hdr = draw(st.sampled_from([b"\xdd", b"\xdf", b"\xc6", b"\xdb", b"\xc5", b"\xdc"]))
            size = draw(st.sampled_from([2**16 - 1, 2**24, 2**31, 2**32 - 1]))
            width = 2 if hdr in (b"\xc5", b"\xdc") else 4
            data[pos:pos] = hdr + (size % (256**width)).to_bytes(width, "big")
    return bytes(data)


# ----------------------------------------------------------------------------- properties


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_decode_or_protocol_error(payload: bytes) -> None:
    _check_all(payload)


@FUZZ
@given(msgpack_trees)
def test_random_msgpack_trees_decode_or_protocol_error(tree: Any) -> None:
    _check_all(msgpack.packb(tree, use_bin_type=True))


@FUZZ
@given(near_valid_bodies())
def test_near_valid_job_maps_decode_or_protocol_error(body: dict[str, Any]) -> None:
    payload = msgpack.packb(body, use_bin_type=True)
    _check_all(payload)


@FUZZ
@given(mutated_payloads())
def test_mutated_valid_payloads_decode_or_protocol_error(payload: bytes) -> None:
    _check_all(payload)


def _job_with_meta(meta: Any) -> tuple[bytes, dict[str, Any]]:
    fields: dict[str, Any] = {
        "job_id": "j",
        "mode": MODES[0],
        "reply_to": "r",
        "seqs": [{"tokens": [1, 2], "prompt_len": 1}],
        "temperature": 1.0,
        "deadline_ms": None,
        "meta": meta,
    }
    payload = protocol.encode_job(
        fields["job_id"], fields["mode"], fields["reply_to"], fields["seqs"], meta=meta
    )
    return payload, fields


@FUZZ
@given(valid_jobs())
@example(_job_with_meta({"": float("nan")}))  # the NaN that once failed a fresh clone's CI
def test_valid_jobs_round_trip_exactly(job_and_fields: tuple[bytes, dict[str, Any]]) -> None:
    payload, f = job_and_fields
    job = _decode_job_or_protocol_error(payload, protocol.DEFAULT_LIMITS)
    assert job is not None
    assert (job.id, job.mode, job.reply_to) == (f["job_id"], f["mode"], f["reply_to"])
    assert job.temperature == f["temperature"] and job.deadline_ms == f["deadline_ms"]
    assert same_value(job.meta, f["meta"]), (job.meta, f["meta"])  # NaN in meta echoes as NaN
    for spec, seq in zip(job.seqs, f["seqs"], strict=True):
        assert spec.text == seq.get("text")
        assert list(spec.tokens) == seq.get("tokens", [])
        assert spec.prompt_len == seq.get("prompt_len")
        assert spec.mask == (bytes(seq["mask"]) if "mask" in seq else None)
    env = protocol.peek_envelope(payload)
    assert env["id"] == f["job_id"] and env["reply_to"] == f["reply_to"]


@FUZZ
@given(valid_jobs(), st.randoms(use_true_random=False), st.integers(1025, 20_000))
def test_envelope_of_an_oversized_job_is_read_in_any_key_order(
    job_and_fields: tuple[bytes, dict[str, Any]], rnd: Any, junk_bytes: int
) -> None:
    """A valid job grown past ``max_payload_bytes`` by an extra value, keys in any order: the
    decoder rejects it with the size message and ``peek_envelope`` still reads its address."""
    payload, f = job_and_fields
    body = msgpack.unpackb(payload)
    body["junk"] = rnd.choice([b"x" * junk_bytes, "y" * junk_bytes, [0] * junk_bytes])
    items = list(body.items())
    rnd.shuffle(items)
    big = msgpack.packb(dict(items), use_bin_type=True)
    limits = Limits(max_payload_bytes=1024)
    with pytest.raises(ProtocolError, match="over the limit of 1024"):
        protocol.decode_job(big, limits)
    env = protocol.peek_envelope(big, limits)
    assert env["v"] == 1 and env["id"] == f["job_id"] and env["reply_to"] == f["reply_to"]
    if f["meta"] is not None and len(msgpack.packb(f["meta"])) <= limits.max_meta_bytes:
        assert msgpack.packb(env["meta"]) == msgpack.packb(f["meta"])


@FUZZ
@given(
    st.fixed_dictionaries(
        {"v": st.just(1), "id": st.text(max_size=8) | _leaf, "ok": _leaf},
        optional={
            "seqs": st.lists(
                st.dictionaries(st.sampled_from(["logps", "reward", "token_scores"]), _leaf)
                | _leaf,
                max_size=3,
            )
            | _leaf,
            "error": st.dictionaries(st.sampled_from(["code", "message"]), _leaf) | _leaf,
            "info": msgpack_trees,
            "meta": msgpack_trees,
        },
    )
)
def test_near_valid_results_decode_or_protocol_error(body: dict[str, Any]) -> None:
    _decode_result_or_protocol_error(msgpack.packb(body, use_bin_type=True))


# ----------------------------------------------------------------------------- bounds


def _peak_bytes(payload: bytes, limits: Limits = protocol.DEFAULT_LIMITS) -> tuple[int, float]:
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ProtocolError):
            protocol.decode_job(payload, limits)
        protocol.peek_envelope(payload, limits)
        elapsed = time.perf_counter() - t0
        return tracemalloc.get_traced_memory()[1], elapsed
    finally:
        tracemalloc.stop()


def _u32(n: int) -> bytes:
    return struct.pack(">I", n)


def _p(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


# A job map header (5 pairs) with four valid pairs; the fifth key is "seqs", value follows.
_HEAD = b"\x85" + b"".join(
    _p(x) for x in ("v", 1, "id", "a", "mode", "reference", "reply_to", "r", "seqs")
)


@pytest.mark.parametrize(
    "name, payload",
    [
        ("array32 claims 4G entries", b"\xdd" + _u32(2**32 - 1)),
        ("array32 claims max_tokens entries", b"\xdd" + _u32(4 * 1024 * 1024)),
        ("map32 claims 4G pairs", b"\xdf" + _u32(2**32 - 1)),
        ("bin32 claims 2 GiB", b"\xc6" + _u32(2**31) + b"x" * 64),
        ("str32 claims 2 GiB", b"\xdb" + _u32(2**31) + b"x" * 64),
        ("ext32 claims 2 GiB", b"\xc9" + _u32(2**31) + b"\x01" + b"x" * 64),
        ("1000 nested arrays each claiming 4M", (b"\xdd" + _u32(4 * 1024 * 1024)) * 1000),
        ("seqs array claims 4M maps", _HEAD + b"\xdd" + _u32(4 * 1024 * 1024)),
        (
            "seqs array claims 4M maps, 4M entries present",
            _HEAD + b"\xdd" + _u32(2**22) + b"\x80" * 2**22,
        ),
        (
            "tokens bin claims 2 GiB",
            _HEAD + b"\x91\x82" + _p("prompt_len") + b"\x01" + _p("tokens") + b"\xc6" + _u32(2**31),
        ),
        (
            "tokens array claims 4M ints",
            _HEAD + b"\x91\x82" + _p("prompt_len") + b"\x01" + _p("tokens") + b"\xdd" + _u32(2**22),
        ),
        ("deep nesting past the unpacker stack", b"\x91" * 5000 + b"\x01"),
    ],
)
def test_huge_headers_allocate_bounded_memory(name: str, payload: bytes) -> None:
    peak, elapsed = _peak_bytes(payload)
    # Memory tracks the bytes that are actually there, never what a header claims.
    assert peak < 256 * 1024 + 64 * len(payload), f"{name}: peak {peak} bytes"
    assert elapsed < 5.0, f"{name}: took {elapsed:.3f}s"  # generous: CI cores are shared


def test_payload_over_the_byte_limit_is_rejected_before_unpacking() -> None:
    limits = Limits(max_payload_bytes=1024)
    big = msgpack.packb({"v": 1, "meta": "x" * 4096}, use_bin_type=True)
    with pytest.raises(ProtocolError, match="over the limit"):
        protocol.decode_job(big, limits)


def test_token_and_sequence_limits_hold_for_bin_and_array_tokens() -> None:
    limits = Limits(max_seqs=2, max_tokens=10)

    def body(seqs: list[Any]) -> bytes:
        return msgpack.packb(
            {"v": 1, "id": "a", "mode": "reference", "reply_to": "r", "seqs": seqs},
            use_bin_type=True,
        )

    with pytest.raises(ProtocolError, match="sequences"):
        protocol.decode_job(body([{"tokens": [1, 2], "prompt_len": 1}] * 3), limits)
    with pytest.raises(ProtocolError, match=r"tokens|max_array_len"):
        protocol.decode_job(body([{"tokens": list(range(11)), "prompt_len": 1}]), limits)
    with pytest.raises(ProtocolError, match="tokens"):
        protocol.decode_job(
            body([{"tokens": struct.pack("<11i", *range(11)), "prompt_len": 1}]), limits
        )


def test_nested_array_headers_do_not_grow_resident_memory() -> None:
    """1000 nested arrays each claiming the payload's size: the unpacker pre-allocates their
    pointer arrays zeroed (calloc, untouched pages), so resident memory stays flat."""
    code = (
        "import resource, struct\n"
        "from worker import protocol\n"
        "from worker.errors import ProtocolError\n"
        "payload = (b'\\xdd' + struct.pack('>I', 5000)) * 1000\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "for _ in range(20):\n"
        "    try:\n"
        "        protocol.decode_job(payload)\n"
        "    except ProtocolError:\n"
        "        pass\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    grown_kib = int(out.stdout.strip())
    assert grown_kib < 64 * 1024, f"resident memory grew by {grown_kib} KiB"


@pytest.mark.slow
def test_max_size_garbage_decodes_fast() -> None:
    """A payload at the byte limit full of small ints is rejected in well under a second."""
    limits = Limits(max_payload_bytes=4 * 1024 * 1024)
    payload = b"\xdd" + _u32(4 * 1024 * 1024 - 16) + b"\x01" * (4 * 1024 * 1024 - 16)
    t0 = time.perf_counter()
    with pytest.raises(ProtocolError):
        protocol.decode_job(payload, limits)
    assert time.perf_counter() - t0 < 10.0
