"""Images of coalesced callers (``worker.client.images.merge_images``, ``caller_images``): one
job's list holds each distinct file once, in order of first appearance, and each sequence's
indices are renumbered into it; a sequence naming an image its caller did not pass is refused
before anything is sent."""

from __future__ import annotations

import pytest

from worker import protocol
from worker.client.images import caller_images, merge_images
from worker.client.inputs import normalize_seqs
from worker.errors import BadRequest


def _seqs(*refs: list[int] | None) -> list[protocol.SeqSpec]:
    maps = [{"tokens": [1, 2, 3], "prompt_len": 1, **({"images": r} if r else {})} for r in refs]
    return normalize_seqs(maps, None)


def test_each_distinct_file_goes_once_and_indices_follow_it() -> None:
    a, b, c = b"\x89PNG-a", b"\x89PNG-b", b"\x89PNG-c"
    parts = [
        (_seqs([0], [0]), (a,)),  # a group's two samples, one prompt image
        (_seqs([0]), (a,)),  # the same image passed again by another caller
        (_seqs([1, 0], None), (c, b)),  # b then c shown, and a text-only sequence
    ]
    seqs, files = merge_images(parts)
    assert files == [a, c, b]
    assert [s.images for s in seqs] == [(0,), (0,), (0,), (2, 1), None]
    assert [s.tokens for s in seqs] == [s.tokens for p in parts for s in p[0]]


def test_a_caller_naming_an_image_it_did_not_pass_is_refused() -> None:
    assert caller_images(_seqs(None), None) == ()
    assert caller_images(_seqs(None), []) == ()
    assert caller_images(_seqs([0]), [b"x"]) == (b"x",)
    with pytest.raises(BadRequest, match=r"seqs\[0\]: image index 1 is out of range"):
        caller_images(_seqs([1]), [b"x"])
    with pytest.raises(BadRequest, match="out of range"):
        caller_images(_seqs([0]), None)
