"""Images through a real worker (real Redis, the daemon in a thread, a tiny Qwen2-VL, Qwen2.5-VL,
Qwen3-VL and Qwen3-VL-MoE loaded from checkpoints saved with their image processor): log-probs
with a temperature and a mask, entropy and top-k of several sequences in one job (one image
shown by several of them, one shown twice by one) equal transformers' own forward of each
sequence alone; a sequence whose image run does not match its image is answered ``bad_request``
naming it while the other jobs are answered; every bad image is ``bad_request`` in well under a
second."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import redis
import transformers

from tests.support.daemon import thread_worker
from tests.support.vision import (
    IMAGE,
    image_file,
    image_tokens,
    placeholder,
    png_header,
    reference,
)
from worker import keys
from worker.client import ScoringClient
from worker.client.errors import BadRequestError
from worker.demo.tiny import VLM_ARCHS, save_tiny_vlm
from worker.executor import ExecutorConfig, StatelessExecutor

pytestmark = pytest.mark.redis

A, B = image_file(90, 60, seed=1), image_file(50, 100, seed=2, fmt="JPEG")


@pytest.fixture(scope="module", params=VLM_ARCHS)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param, seed=3)


@pytest.fixture(scope="module")
def naive(checkpoint: Path) -> tuple[Any, Any]:
    """The checkpoint loaded by transformers alone, with its processor."""
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    cls = getattr(transformers, config.architectures[0])
    model = cls.from_pretrained(checkpoint, dtype="float32").eval()
    return model, transformers.AutoImageProcessor.from_pretrained(checkpoint)


def _executor(checkpoint: Path, **config: Any) -> StatelessExecutor:
    return StatelessExecutor.from_pretrained(
        ExecutorConfig(dtype="float32", **config), str(checkpoint)
    )


@pytest.fixture
def served(
    checkpoint: Path, redis_url: str, key_prefix: str, cleanup_keys: None
) -> Iterator[tuple[Any, Any]]:
    ex = _executor(checkpoint, max_image_pixels=200 * 200, max_images_per_job=3)
    with thread_worker(redis_url, key_prefix, ex) as (worker, registry):
        yield worker, registry


def test_image_sequences_equal_the_model_alone_through_redis(
    served: tuple[Any, Any], naive: tuple[Any, Any], redis_url: str, key_prefix: str
) -> None:
    model, processor = naive
    na, nb = image_tokens(processor, A), image_tokens(processor, B)
    rng = np.random.RandomState(0)

    def text(n: int) -> list[int]:
        return [int(t) for t in rng.randint(1, 90, n)]

    s0 = [*text(3), *placeholder(na), *text(4)]  # A
    s1 = [*text(2), *placeholder(na), *text(2), *placeholder(nb), *text(5)]  # A then B
    s2 = [*text(2), *placeholder(nb), *placeholder(nb), *text(3)]  # B twice
    s3 = text(9)  # text only
    mask1 = [0] * (len(s1) - 5) + [1, 0, 1, 1, 1]
    seqs = [
        {"tokens": s0, "prompt_len": len(s0) - 4, "images": [0]},
        {"tokens": s1, "mask": mask1, "images": [0, 1]},
        {"tokens": s2, "prompt_len": 2 + 2 * (nb + 2), "images": [1, 1]},
        {"tokens": s3, "prompt_len": 4},
    ]
    temp, k = 0.7, 3
    with ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True) as client:
        got = client.score(
            seqs, temperature=temp, outputs=("logps", "entropy", "topk"), topk=k,
            images=[A, B], timeout=60,
        )  # fmt: skip
    refs = [[0], [0, 1], [1, 1], []]
    for seq, score, shown in zip(seqs, got, refs, strict=True):
        tokens = seq["tokens"]
        want = reference(model, processor, [A, B], tokens, shown, temperature=temp, topk=k)
        if "mask" in seq:
            scored = [t for t, m in enumerate(seq["mask"]) if m]
        else:
            scored = list(range(seq["prompt_len"], len(tokens)))
        at = np.array(scored) - 1  # the position that predicts each scored token
        np.testing.assert_allclose(score.logps, want["logps"][at], atol=2e-5, rtol=0)
        np.testing.assert_allclose(score.entropy, want["entropy"][at], atol=2e-5, rtol=0)
        np.testing.assert_allclose(score.topk_logps, want["topk_logps"][at], atol=2e-5, rtol=0)
        np.testing.assert_array_equal(score.topk_ids, want["topk_ids"][at])
    _, registry = served
    assert registry.get_sample_value("scoring_images_decoded_total") == 2
    assert registry.get_sample_value("scoring_image_tokens_total") == 2 * na + 3 * nb
    assert registry.get_sample_value("scoring_vision_tower_seconds_total") > 0
    assert registry.get_sample_value("scoring_vision_tower_images_total") == 2  # A and B once


def test_a_group_prompt_image_is_sent_once_and_scored_for_every_completion(
    served: tuple[Any, Any], naive: tuple[Any, Any], redis_url: str, key_prefix: str
) -> None:
    model, processor = naive
    prompt = [3, 4, *placeholder(image_tokens(processor, A)), 5]
    completions = [[6, 7, 8], [9, 10], [11, 12, 13, 14]]
    with ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True) as client:
        got = client.score_groups(prompt, completions, images=[A], timeout=60)
    for c, score in zip(completions, got, strict=True):
        want = reference(model, processor, [A], prompt + c, [0])["logps"][len(prompt) - 1 :]
        np.testing.assert_allclose(score.logps, want, atol=2e-5, rtol=0)


def _raw(job_id: str, reply: str, seqs: list[dict[str, Any]], **more: Any) -> bytes:
    """A job as docs/protocol.md spells it (msgpack only)."""
    body = {"v": 1, "id": job_id, "mode": "reference", "reply_to": reply, "seqs": seqs, **more}
    return msgpack.packb(body, use_bin_type=True)


REPLY = f"vision-test:reply:{uuid.uuid4().hex[:8]}"


def _ask(url: str, stream: str, jobs: dict[str, bytes]) -> dict[str, tuple[dict, float]]:
    """XADD every job at once (each answering to ``REPLY``); each raw result with the seconds
    it took to arrive."""
    r = redis.Redis.from_url(url)
    reply = REPLY
    r.delete(reply)
    sent = {}
    for job_id, payload in jobs.items():
        sent[job_id] = time.monotonic()
        r.xadd(stream, {"payload": payload})
    got: dict[str, tuple[dict, float]] = {}
    last, deadline = "0", time.monotonic() + 60
    while len(got) < len(jobs) and time.monotonic() < deadline:
        for _, entries in r.xread({reply: last}, block=100) or []:
            for eid, fields in entries:
                last = eid
                body = msgpack.unpackb(fields[b"payload"], raw=False)
                got[body["id"]] = (body, time.monotonic() - sent[body["id"]])
    assert sorted(got) == sorted(jobs)
    return got


def test_a_run_that_does_not_match_its_image_is_refused_naming_the_sequence(
    served: tuple[Any, Any], naive: tuple[Any, Any], redis_url: str, key_prefix: str
) -> None:
    _, processor = naive
    n = image_tokens(processor, A)
    good = {"tokens": [1, 2, *placeholder(n), 3, 4], "prompt_len": n + 4, "images": [0]}
    short = {"tokens": [1, 2, *placeholder(n - 1), 3, 4], "prompt_len": n + 3, "images": [0]}
    stream = keys.job_streams(key_prefix)[0]
    got = _ask(redis_url, stream, {
        "ok-1": _raw("ok-1", REPLY, [good, good], images=[A]),
        "bad": _raw("bad", REPLY, [good, short, good], images=[A]),
        "ok-2": _raw("ok-2", REPLY, [good], images=[A]),
    })  # fmt: skip
    bad = got["bad"][0]
    assert bad["ok"] is False and bad["error"]["code"] == "bad_request"
    message = bad["error"]["message"]
    assert "sequence 1" in message and "images[0]" in message, message
    assert f"{n - 1} image tokens" in message and f"makes {n}" in message, message
    for job in ("ok-1", "ok-2"):
        assert got[job][0]["ok"] is True, got[job][0]
        info = got[job][0]["info"]["vision"]
        assert info["processor"].startswith("Qwen2VLImageProcessor") and info["backend"] == "pil"


BAD_IMAGES = {
    "bomb": (png_header(30000, 30000), "over the worker's limit"),
    "over-limit": (image_file(300, 300), "over the worker's limit"),
    "truncated": (image_file(60, 60)[:300], "does not decode"),
    "not-an-image": (b"#!/bin/sh\necho hello\n", "not a PNG, JPEG or WebP"),
    "gif": (image_file(60, 60, fmt="GIF"), "not a PNG, JPEG or WebP"),
}


def test_every_bad_image_is_bad_request_in_well_under_a_second_and_alone(
    served: tuple[Any, Any], naive: tuple[Any, Any], redis_url: str, key_prefix: str
) -> None:
    _, processor = naive
    n = image_tokens(processor, A)
    seq = {"tokens": [1, *placeholder(n), 2, 3], "prompt_len": n + 3, "images": [0]}
    jobs = {name: _raw(name, REPLY, [seq], images=[data]) for name, (data, _) in BAD_IMAGES.items()}
    jobs["out-of-range"] = _raw("out-of-range", REPLY, [{**seq, "images": [1]}], images=[A])
    jobs["unused"] = _raw("unused", REPLY, [seq], images=[A, B])
    four = [{**seq, "images": [k]} for k in range(4)]
    jobs["too-many"] = _raw("too-many", REPLY, four, images=[A] * 4)
    jobs["a-url"] = _raw("a-url", REPLY, [seq], images=["https://example.com/a.png"])
    jobs["video"] = _raw("video", REPLY, [{"tokens": [1, 95, 2], "prompt_len": 1}])
    jobs["good"] = _raw("good", REPLY, [seq], images=[A])
    got = _ask(redis_url, keys.job_streams(key_prefix)[0], jobs)
    expected = {name: why for name, (_, why) in BAD_IMAGES.items()}
    expected.update({
        "out-of-range": "out of range", "unused": "not shown by any sequence",
        "too-many": "over the worker's limit of 3", "a-url": "array of bin", "video": "video",
    })  # fmt: skip
    for name, why in expected.items():
        body, seconds = got[name]
        assert body["ok"] is False and body["error"]["code"] == "bad_request", (name, body)
        assert why in body["error"]["message"], (name, body["error"]["message"])
        assert seconds < 1.0, (name, seconds)
    assert got["good"][0]["ok"] is True


def test_the_client_refuses_a_sequence_naming_a_missing_image(
    served: tuple[Any, Any], redis_url: str, key_prefix: str
) -> None:
    seq = {"tokens": [1, IMAGE, 2], "prompt_len": 1, "images": [2]}
    client = ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True)
    with client, pytest.raises(BadRequestError, match="out of range"):
        client.score([seq], images=[A], timeout=10)
