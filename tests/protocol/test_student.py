"""Student text, torch-free: the ``StudentView`` checks, its wire round trip, and the alignment
rules of ``worker.scorer.align`` on hand-made spans (a piece of a character, an empty-span
token, a gap no token covers)."""

from __future__ import annotations

from array import array

import msgpack
import numpy as np
import pytest

from worker.errors import BadRequest, ProtocolError
from worker.protocol import SeqSpec, decode_job, encode_job
from worker.request import StudentView
from worker.scorer.align import align, byte_spans, cut_points, span_arrays


def test_a_student_view_is_checked_and_round_trips() -> None:
    view = StudentView(prompt="Q:", tokens=(" a", "😀", "b"))
    assert view.completion == " a😀b" and view.cuts() == [0, 2, 6, 7]
    by_bytes = StudentView(messages=[{"role": "user", "content": "x"}], completion=" a😀b",
                           offsets=(0, 2, 4))  # fmt: skip
    assert by_bytes.cuts() == [0, 2, 4, 7]  # a cut inside the emoji
    for seq in ({"student": {"prompt": "Q:", "tokens": [" a", "😀", "b"]}},
                {"student": {"messages": [{"role": "user", "content": "x"}],
                             "completion": " a😀b", "offsets": [0, 2, 4]}}):  # fmt: skip
        job = decode_job(encode_job("j", "reference", "r", [seq]))
        assert job.seqs[0].student in (view, by_bytes)
    with pytest.raises(BadRequest, match="not the completion"):
        StudentView(prompt="Q:", tokens=("a", "b"), completion="ax")
    with pytest.raises(BadRequest, match="exactly one of prompt"):
        StudentView(tokens=("a",))
    with pytest.raises(BadRequest, match="increase strictly"):
        StudentView(prompt="", completion="abc", offsets=(0, 2, 2))
    with pytest.raises(BadRequest, match="non-empty strings"):
        StudentView(prompt="", tokens=("a", ""))
    with pytest.raises(ProtocolError, match="mode reference"):
        encode_job("j", "both", "r", [{"student": {"prompt": "Q", "tokens": ["a"]}}])
    with pytest.raises(ProtocolError, match="all student text or all token ids"):
        seqs = [{"student": {"prompt": "Q", "tokens": ["a"]}}, {"tokens": [1, 2], "prompt_len": 1}]
        encode_job("j", "reference", "r", seqs)


def test_cuts_fall_where_both_sides_agree() -> None:
    text = "a😀b"  # bytes: a=0, emoji=1..5, b=5
    spans = byte_spans(text, [(0, 1), (1, 2), (1, 2), (2, 3)])  # the emoji in two pieces
    assert spans.tolist() == [[0, 1], [1, 5], [1, 5], [5, 6]]
    assert cut_points(spans, 6) == {0: 0, 1: 1, 5: 3, 6: 4}  # none between the two pieces
    # an empty-span token joins the next one; bytes no token covers go to the token before
    assert cut_points(np.array([[0, 1], [1, 1], [1, 2], [3, 4]]), 4) == {0: 0, 1: 1, 3: 3, 4: 4}
    alignment = align([0, 3, 5, 6], spans, 6)  # student: "a" + 2 emoji bytes, 2 bytes, "b"
    assert alignment.span_student.tolist() == [[0, 2], [2, 3]]
    assert alignment.span_teacher.tolist() == [[0, 3], [3, 4]]
    out = span_arrays(alignment, np.array([7, 8, 9, 10]), np.array([-1.0, -2.0, -0.5, -3.0]))
    assert out["span_logps"].tolist() == [-3.5, -3.0]
    assert out["teacher_ids"].tolist() == [7, 8, 9, 10]
    with pytest.raises(BadRequest, match="no tokens"):
        align([0, 1], np.zeros((0, 2), np.int64), 1)


def test_a_student_job_takes_no_prefix_nor_per_sequence_gather_ids() -> None:
    """Refused when a producer encodes such a job and when a raw payload carries one (the
    worker's intake answers ``bad_request``): a student view's prompt is its own text, and its
    rows are teacher tokens, unknown before the worker tokenizes."""
    seq = {"student": {"prompt": "Q", "tokens": ["a"]}}
    with pytest.raises(ProtocolError, match="carries no prefix"):
        encode_job("j", "reference", "r", [SeqSpec(array("i"), student=StudentView(
            prompt="Q", tokens=("a",)))], prefix=[3])  # fmt: skip
    with pytest.raises(ProtocolError, match="a student sequence carries no gather_ids"):
        encode_job("j", "reference", "r", [{**seq, "gather_ids": [[1]]}])
    body = {"v": 1, "id": "x", "mode": "reference", "reply_to": "r", "seqs": [seq]}
    with pytest.raises(ProtocolError, match="carries no prefix"):
        decode_job(msgpack.packb({**body, "prefix": [3]}))
    with pytest.raises(ProtocolError, match="a student sequence carries no gather_ids"):
        decode_job(msgpack.packb({**body, "seqs": [{**seq, "gather_ids": [[1]]}]}))
    with pytest.raises(ProtocolError, match="mode reference"):
        decode_job(msgpack.packb({**body, "mode": "both"}))
