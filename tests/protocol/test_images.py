"""The job's ``images``, ``processor`` and each sequence's ``images`` on the wire: encoded once
per job, decoded strictly (bin files, integer indices, known options), the indices checked
against the files; a job without them is byte-identical to before."""

from __future__ import annotations

import base64
import io
from typing import Any

import msgpack
import pytest

from worker import protocol
from worker.client.images import image_bytes, images_from_base64, job_images
from worker.client.inputs import group_seqs, normalize_seqs
from worker.errors import BadRequest, ProtocolError
from worker.request import Images, ScoreRequest, SequenceInput

PNG = b"\x89PNG fake bytes: never decoded by the protocol"


def _body(**more: Any) -> dict[str, Any]:
    seq = {"tokens": [1, 2, 3], "prompt_len": 1, "images": [0]}
    return {"v": 1, "id": "j", "mode": "reference", "reply_to": "r", "seqs": [seq], **more}


def test_images_travel_once_and_decode_to_the_same_job() -> None:
    images = Images((PNG, b"other"), {"max_pixels": 4096})
    seqs = normalize_seqs([
        {"tokens": [1, 2, 3], "prompt_len": 1, "images": [0, 1, 0]},
        {"tokens": [4, 5], "prompt_len": 1, "images": [1]},
    ])  # fmt: skip
    payload = protocol.encode_job("j", "reference", "r", seqs, images=images)
    body = msgpack.unpackb(payload)
    assert body["images"] == [PNG, b"other"] and body["processor"] == {"max_pixels": 4096}
    assert [s["images"] for s in body["seqs"]] == [[0, 1, 0], [1]]
    job = protocol.decode_job(payload)
    assert job.images == images
    assert [s.images for s in job.seqs] == [(0, 1, 0), (1,)]


def test_text_and_messages_sequences_carry_their_images_too() -> None:
    """A reward sequence the worker tokenizes names its images as a token sequence does (the
    worker decides whether it serves them: mode ``reference`` only, so far)."""
    seqs = normalize_seqs([
        {"text": "a picture: a cat", "images": [0]},
        {"messages": [{"role": "user", "content": "hi"}], "images": [0, 0]},
    ])  # fmt: skip
    payload = protocol.encode_job("j", "reward", "r", seqs, images=Images((PNG,)))
    job = protocol.decode_job(payload)
    assert [s.images for s in job.seqs] == [(0,), (0, 0)]
    assert [s.text for s in job.seqs] == ["a picture: a cat", None]


def test_a_job_without_images_is_unchanged() -> None:
    payload = protocol.encode_job("j", "reference", "r", normalize_seqs([([1, 2], 1)]))
    assert b"images" not in payload and protocol.decode_job(payload).images is None


@pytest.mark.parametrize(
    "more, match",
    [
        ({"images": ["https://example.com/a.png"]}, "array of bin"),
        ({"images": PNG}, "array of bin"),
        ({"images": []}, "at least one image"),
        ({"images": [PNG], "processor": {"resample": 3}}, "not one of"),
        ({"images": [PNG], "processor": {"max_pixels": -1}}, "max_pixels"),
        ({"images": [PNG], "processor": {"min_pixels": 900, "max_pixels": 100}}, "above"),
        ({"processor": {"max_pixels": 100}}, "no images"),
    ],
    ids=["url", "not-a-list", "empty", "unknown-option", "negative", "min-over-max", "no-images"],
)
def test_a_malformed_image_field_is_a_protocol_error(more: dict, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        protocol.decode_job(msgpack.packb(_body(**more)))


def test_a_sequence_index_must_be_an_integer() -> None:
    body = _body(images=[PNG])
    body["seqs"][0]["images"] = ["0"]
    with pytest.raises(ProtocolError, match=r"seqs\[0\].images"):
        protocol.decode_job(msgpack.packb(body))


def test_indices_are_checked_against_the_files() -> None:
    seq = SequenceInput([1, 2], 1, images=(1,))
    with pytest.raises(BadRequest, match="sequence 0: image index 1 is out of range"):
        ScoreRequest([seq], images=Images((PNG,)))
    with pytest.raises(BadRequest, match=r"images \[1\] are not shown"):
        ScoreRequest([SequenceInput([1, 2], 1, images=(0,))], images=Images((PNG, PNG)))
    with pytest.raises(ProtocolError, match="out of range"):  # the producer fails fast
        wire = normalize_seqs([{"tokens": [1, 2], "prompt_len": 1, "images": [1]}])
        protocol.encode_job("j", "reference", "r", wire, images=Images((PNG,)))


def test_the_client_takes_bytes_paths_and_pil_images(tmp_path: Any) -> None:
    from PIL import Image

    path = tmp_path / "a.png"
    Image.new("RGB", (4, 3), "red").save(path)
    data = path.read_bytes()
    assert image_bytes(data) == data and image_bytes(str(path)) == data
    decoded = Image.open(path)
    assert Image.open(io.BytesIO(image_bytes(decoded))).size == (4, 3)
    assert job_images([data, path], {"min_pixels": 10}) == Images((data, data), {"min_pixels": 10})
    assert job_images(None) is None
    with pytest.raises(BadRequest, match="bytes, a path or a PIL image"):
        image_bytes(3)
    assert images_from_base64([base64.b64encode(data).decode()]) == [data]
    with pytest.raises(BadRequest, match="base64"):
        images_from_base64(["not base64!"])


def test_a_group_shows_the_prompt_images_in_every_completion_that_names_none() -> None:
    assert group_seqs([[1], {"tokens": [2], "images": []}], [PNG]) == [
        {"tokens": [1], "images": [0]},
        {"tokens": [2], "images": []},
    ]
