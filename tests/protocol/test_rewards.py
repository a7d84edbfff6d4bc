"""Reward inputs on the wire: messages, step_positions, the step map and the result keys
(additive: old jobs and results are unchanged)."""

from __future__ import annotations

from array import array

import msgpack
import pytest

from worker.client.inputs import normalize_seqs
from worker.errors import BadRequest, ProtocolError
from worker.protocol import (
    Result,
    SeqResult,
    StepSpec,
    decode_job,
    decode_result,
    encode_job,
    encode_result,
)

MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "name": "a"}]


def test_messages_only_reward_job_round_trips_and_matches_the_documented_bytes() -> None:
    payload = encode_job("j1", "reward", "r", [{"messages": [{"role": "user", "content": "hi"}]}])
    body = msgpack.unpackb(payload)
    assert body["seqs"] == [{"messages": [{"role": "user", "content": "hi"}]}]
    documented = bytes.fromhex(
        "85 a1 76 01 a2 69 64 a2 6a 31 a4 6d 6f 64 65 a6 72 65 77 61 72 64 a8 72 65 70 6c 79 5f"
        " 74 6f a1 72 a4 73 65 71 73 91 81 a8 6d 65 73 73 61 67 65 73 91 82 a4 72 6f 6c 65 a4 75"
        " 73 65 72 a7 63 6f 6e 74 65 6e 74 a2 68 69"
    )
    (seq,) = decode_job(documented).seqs
    assert seq.messages == ({"role": "user", "content": "hi"},) and len(seq.tokens) == 0
    job = decode_job(
        encode_job("j2", "both", "r", [{"tokens": [1, 2, 3], "prompt_len": 1, "messages": MSGS}])
    )
    assert job.seqs[0].messages == tuple(MSGS) and list(job.seqs[0].tokens) == [1, 2, 3]


def test_step_map_and_positions_round_trip() -> None:
    step = {"tag_id": 7, "label_token_ids": [11, 12]}
    job = decode_job(
        encode_job("j", "reward", "r", [{"tokens": [1, 7, 3], "prompt_len": 1}], step=step)
    )
    assert job.step == StepSpec(tag_id=7, label_token_ids=(11, 12), positive_index=1)
    given = [
        {"tokens": [1, 2, 3], "prompt_len": 1, "step_positions": [0, 2]},
        {"messages": MSGS, "step_positions": array("i", [4])},
    ]
    job = decode_job(encode_job("j", "reward", "r", given, step={"positive_index": 0}))
    assert [list(s.step_positions or ()) for s in job.seqs] == [[0, 2], [4]]
    assert (
        decode_job(encode_job("j", "reward", "r", [{"tokens": [1, 2], "prompt_len": 1}])).step
        is None
    )  # old jobs


@pytest.mark.parametrize(
    ("mode", "seqs", "extra", "match"),
    [
        ("reference", [{"tokens": [1, 2], "prompt_len": 1, "messages": MSGS}], {}, "reward"),
        ("both", [{"messages": MSGS}], {}, "needs tokens"),
        ("reward", [{"messages": "hi"}], {}, "non-empty array"),
        ("reward", [{"messages": [{"role": "user"}]}], {}, "content must be a string"),
        ("reward", [{"messages": [{"role": 1, "content": "x"}]}], {}, "role"),
        ("reward", [{"messages": MSGS, "prompt_len": 1}], {}, "need tokens"),
        ("both", [{"tokens": [1, 2], "prompt_len": 1}], {"step": {"tag_id": 1}}, "mode 'reward'"),
        (
            "reward",
            [{"tokens": [1, 2], "prompt_len": 1}],
            {"step": {}},
            "tag_id, or step_positions",
        ),
        ("reward", [{"tokens": [1, 2], "prompt_len": 1}], {"step": {"tag_id": -1}}, "tag_id"),
        (
            "reward",
            [{"tokens": [1, 2], "prompt_len": 1}],
            {"step": {"tag_id": 1, "x": 2}},
            "unknown keys",
        ),
        (
            "reward",
            [{"tokens": [1, 2], "prompt_len": 1}],
            {"step": {"label_token_ids": [3]}},
            "good, bad",
        ),
        (
            "reward",
            [{"tokens": [1, 2], "prompt_len": 1, "step_positions": [1, 1]}],
            {"step": {}},
            "increasing",
        ),
        (
            "reward",
            [{"tokens": [1, 2], "prompt_len": 1, "step_positions": [1]}],
            {},
            "need a step map",
        ),
    ],
)
def test_bad_reward_inputs_are_protocol_errors(
    mode: str, seqs: list[dict], extra: dict, match: str
) -> None:
    body = {"v": 1, "id": "j", "mode": mode, "reply_to": "r", "seqs": seqs, **extra}
    with pytest.raises(ProtocolError, match=match):
        decode_job(msgpack.packb(body, use_bin_type=True))


def test_result_keys_round_trip_and_stay_absent_when_unset() -> None:
    res = Result(id="j", ok=True, seqs=[
        SeqResult(reward=0.5, rm_tokens=9, rewards=array("f", [0.5, 1.5]),
                  step_positions=array("i", [2, 5]), step_scores=array("f", [0.25, 0.75])),
        SeqResult(reward=1.0),
    ])  # fmt: skip
    payload = encode_result(res)
    assert set(msgpack.unpackb(payload)["seqs"][1]) == {"reward"}
    first, second = decode_result(payload).seqs
    assert first.rm_tokens == 9 and list(first.rewards) == [0.5, 1.5]
    assert list(first.step_positions) == [2, 5] and list(first.step_scores) == [0.25, 0.75]
    assert second.rewards is None and second.step_positions is None and second.rm_tokens is None


def test_client_normalizes_messages_sequences() -> None:
    (spec,) = normalize_seqs([{"messages": MSGS}])
    assert spec.messages == tuple(MSGS)
    (spec,) = normalize_seqs([{"tokens": [1, 2, 3], "prompt_len": 1, "messages": MSGS}])
    assert spec.messages == tuple(MSGS) and spec.prompt_len == 1
    with pytest.raises(BadRequest, match="role"):
        normalize_seqs([{"messages": [{"content": "x"}]}])
