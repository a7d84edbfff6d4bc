"""Mistral-3 (rows of image tokens, ``image_sizes``), SmolVLM with image splitting on (a run per
tile and the global image) and LLaVA-NeXT (anyres) images through a real worker (real Redis, the
daemon in a thread, each tiny model loaded from a checkpoint saved with its image processor):
log-probs with a temperature and a mask, entropy and top-k of several sequences in one job equal
transformers' own forward of each sequence alone; a sequence whose image lacks one of its runs
is answered ``bad_request`` naming it, while the other jobs are answered."""

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
from tests.support.vision import IMAGE, image_file
from tests.support.vision_more import more_reference, placeholder, save_more_vlm
from worker import keys
from worker.client import ScoringClient
from worker.executor import ExecutorConfig, StatelessExecutor

pytestmark = pytest.mark.redis

A, B = image_file(90, 60, seed=1), image_file(50, 100, seed=2, fmt="JPEG")


@pytest.fixture(scope="module", params=["mistral3", "smolvlm_split", "llava_next"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_more_vlm(tmp_path_factory.mktemp(request.param), request.param, seed=3)


@pytest.fixture(scope="module")
def naive(checkpoint: Path) -> tuple[Any, Any]:
    """The checkpoint loaded by transformers alone, with its image processor."""
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    cls = getattr(transformers, config.architectures[0])
    model = cls.from_pretrained(checkpoint, dtype="float32").eval()
    return model, transformers.AutoImageProcessor.from_pretrained(checkpoint)


@pytest.fixture
def served(checkpoint: Path, redis_url: str, key_prefix: str, cleanup_keys: None) -> Iterator[Any]:
    config = ExecutorConfig(dtype="float32", max_image_pixels=200 * 200, max_images_per_job=3)
    ex = StatelessExecutor.from_pretrained(config, str(checkpoint))
    with thread_worker(redis_url, key_prefix, ex) as (_, registry):
        yield registry


def test_image_sequences_equal_the_model_alone_through_redis(
    served: Any, naive: tuple[Any, Any], redis_url: str, key_prefix: str
) -> None:
    model, processor = naive
    pa, pb = placeholder(model, processor, A), placeholder(model, processor, B)
    rng = np.random.RandomState(0)

    def text(n: int) -> list[int]:
        return [int(t) for t in rng.randint(1, 90, n)]

    s0 = [*text(3), *pa, *text(4)]  # A
    s1 = [*text(2), *pa, *text(2), *pb, *text(5)]  # A then B
    s2 = [*text(2), *pb, *text(1), *pb, *text(3)]  # B twice
    s3 = text(9)  # text only
    mask1 = [0] * (len(s1) - 5) + [1, 0, 1, 1, 1]
    seqs = [
        {"tokens": s0, "prompt_len": len(s0) - 4, "images": [0]},
        {"tokens": s1, "mask": mask1, "images": [0, 1]},
        {"tokens": s2, "prompt_len": 2 + len(pb), "images": [1, 1]},
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
        want = more_reference(model, processor, [A, B], tokens, shown, temperature=temp, topk=k)
        if "mask" in seq:
            scored = [t for t, m in enumerate(seq["mask"]) if m]
        else:  # image tokens in a completion are never scored
            scored = [t for t in range(seq["prompt_len"], len(tokens)) if tokens[t] != IMAGE]
        at = np.array(scored) - 1  # the position that predicts each scored token
        np.testing.assert_allclose(score.logps, want["logps"][at], atol=2e-5, rtol=0)
        np.testing.assert_allclose(score.entropy, want["entropy"][at], atol=2e-5, rtol=0)
        np.testing.assert_allclose(score.topk_logps, want["topk_logps"][at], atol=2e-5, rtol=0)
        np.testing.assert_array_equal(score.topk_ids, want["topk_ids"][at])
    assert served.get_sample_value("scoring_images_decoded_total") == 2


REPLY = f"vision-more-test:reply:{uuid.uuid4().hex[:8]}"


def _raw(job_id: str, seqs: list[dict[str, Any]], **more: Any) -> bytes:
    """A job as docs/protocol.md spells it (msgpack only), answering to ``REPLY``."""
    body = {"v": 1, "id": job_id, "mode": "reference", "reply_to": REPLY, "seqs": seqs, **more}
    return msgpack.packb(body, use_bin_type=True)


def test_a_sequence_whose_image_lacks_a_run_is_refused_naming_it(
    served: Any, naive: tuple[Any, Any], redis_url: str, key_prefix: str
) -> None:
    model, processor = naive
    pa = placeholder(model, processor, A)
    last = len(pa) - 1 - pa[::-1].index(IMAGE)
    short = [*pa[:last], *pa[last + 1 :]]  # the image's last run one token short
    good = {"tokens": [1, 2, *pa, 3, 4], "prompt_len": 2, "images": [0]}
    bad = {**good, "tokens": [1, 2, *short, 3, 4]}
    jobs = {
        "ok-1": _raw("ok-1", [good, good], images=[A]),
        "bad": _raw("bad", [good, bad, good], images=[A]),
        "ok-2": _raw("ok-2", [good], images=[A]),
    }
    r = redis.Redis.from_url(redis_url)
    r.delete(REPLY)
    for payload in jobs.values():
        r.xadd(keys.job_streams(key_prefix)[0], {"payload": payload})
    got: dict[str, dict[str, Any]] = {}
    last_id, deadline = "0", time.monotonic() + 60
    while len(got) < len(jobs) and time.monotonic() < deadline:
        for _, entries in r.xread({REPLY: last_id}, block=100) or []:
            for eid, fields in entries:
                last_id = eid
                body = msgpack.unpackb(fields[b"payload"], raw=False)
                got[body["id"]] = body
    assert sorted(got) == sorted(jobs)
    error = got["bad"]["error"]
    assert got["bad"]["ok"] is False and error["code"] == "bad_request"
    assert error["message"].startswith("sequence 1: image run"), error["message"]
    assert "images[0]" in error["message"], error["message"]
    for job in ("ok-1", "ok-2"):
        assert got[job]["ok"] is True, got[job]
        assert got[job]["info"]["vision"]["model"] == type(model).__name__
