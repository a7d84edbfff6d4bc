"""The request vocabulary (worker/request.py): built once, validated where built, carried
unchanged from the producer's arguments through the wire to the decoded job."""

from __future__ import annotations

import pytest

from worker import protocol
from worker.client.core import ClientCore
from worker.errors import BadRequest
from worker.request import (
    DEFAULT_OPTIONS,
    Images,
    Sampling,
    ScoreOptions,
    ScoreRequest,
    SequenceInput,
    StepOptions,
    TokenOutputs,
)

SEQS = [{"tokens": [1, 2, 3, 4], "prompt_len": 1}]
TEACHER = TokenOutputs(
    frozenset({"logps", "topk", "processed_logps"}), topk=5, sampling=Sampling(top_p=0.9)
)


def _decoded(payload: bytes) -> protocol.Job:
    return protocol.decode_job(payload)


@pytest.mark.parametrize(
    "options",
    [
        DEFAULT_OPTIONS,
        ScoreOptions(outputs=TEACHER, adapter="run/step-1"),
        ScoreOptions(version="v2", outputs=TokenOutputs(frozenset({"gather"}), gather_ids=(3, 4))),
    ],
)
def test_options_travel_the_wire_unchanged(options: ScoreOptions) -> None:
    payload = protocol.encode_job("j", "reference", "r", SEQS, options=options)
    assert _decoded(payload).options == options


def test_step_options_travel_the_wire_unchanged() -> None:
    options = ScoreOptions(step=StepOptions(tag_id=3, label_token_ids=(5, 6)))
    payload = protocol.encode_job("j", "reward", "r", SEQS, options=options)
    assert _decoded(payload).options == options


def test_the_client_takes_the_options_whole_or_the_arguments_not_both() -> None:
    core = ClientCore(queue="q", check_workers=False)
    options = ScoreOptions(outputs=TEACHER)
    whole = core.prepare(SEQS, "reference", job_id="a", options=options)
    apart = core.prepare(
        SEQS, "reference", job_id="a",
        outputs={"outputs": ["logps", "topk", "processed_logps"], "topk": 5,
                 "sampling": {"top_p": 0.9}},
    )  # fmt: skip
    assert _decoded(whole.payload).options == _decoded(apart.payload).options == options
    with pytest.raises(BadRequest, match="not both"):
        core.prepare(SEQS, "reference", options=options, adapter="x")


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: ScoreRequest([]), "no sequences"),
        (lambda: ScoreRequest("abc"), "list of SequenceInput"),  # type: ignore[arg-type]
        (lambda: ScoreRequest([SequenceInput([1, 2])], mode="sample"), "unknown mode"),  # type: ignore[arg-type]
        (lambda: ScoreRequest([SequenceInput([1, 2])], temperature=0.0), "temperature"),
        (lambda: ScoreRequest([SequenceInput([1, 2])], temperature=True), "temperature"),
        (lambda: StepOptions(tag_id=-1), "step.tag_id"),
        (lambda: StepOptions(label_token_ids=(4, 4)), "two distinct"),
        (lambda: StepOptions(positive_index=2), "step.positive_index"),
        (lambda: ScoreOptions(outputs={"topk"}), "TokenOutputs"),  # type: ignore[arg-type]
        (lambda: Images(("a.png",)), r"images\[0\] must be the non-empty bytes"),  # type: ignore[arg-type]
        (lambda: Images((b"x",), {"resample": 1}), "not one of"),  # type: ignore[arg-type]
        (lambda: Images((b"x",), {"max_pixels": 0}), "processor.max_pixels"),  # type: ignore[arg-type]
        (lambda: ScoreRequest([SequenceInput([1, 2], images=(0,))]), "out of range"),
        (lambda: ScoreRequest([SequenceInput([1, 2])], images=Images((b"x",))), "not shown"),
    ],
)
def test_each_type_refuses_bad_values_where_it_is_built(build: object, match: str) -> None:
    with pytest.raises(BadRequest, match=match):
        build()  # type: ignore[operator]
