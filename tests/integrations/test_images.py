"""The trainers' image forms through a real worker (real Redis, a tiny Qwen2-VL with its image
processor, the daemon in a thread): verl's ``multi_modal_data`` (``{"image": [PIL images]}`` per
item) through ``verl_ref.ref_log_prob`` answers what the plain client answers for the same
sequences and images (the batch's temperature applied; a group's prompt image on the wire once);
the reward manager and TRL's reward function send their images, and the worker's refusal of an
image reward job reaches the trainer as the plain client's ``BadRequestError``; a malformed form
is a clear error (a ``multi_modal_data`` that is not a dict, an image column of the wrong
length, prompt ids with an image run and no image)."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import redis
from PIL import Image

from tests.support.daemon import thread_worker
from tests.support.vision import image_file, placeholder
from worker import keys, protocol
from worker.client import ScoringClient
from worker.client.errors import BadRequestError, JobFailed
from worker.demo.tiny import save_tiny_vlm
from worker.executor import ExecutorConfig, StatelessExecutor
from worker.integrations.shared import close_all
from worker.integrations.trl import RewardFunction
from worker.integrations.verl_manager import ScoringRewardManager
from worker.integrations.verl_ref import ref_log_prob

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]

A = Image.open(io.BytesIO(image_file(90, 60, seed=1))).convert("RGB")
B = Image.open(io.BytesIO(image_file(50, 100, seed=2))).convert("RGB")
PAD = 0


class Item:
    """One item of a verl ``DataProto``: left-padded prompt, right-padded response."""

    def __init__(self, prompt: list[int], response: list[int], images: list[Any], width: int):
        p = [PAD] * (width - len(prompt)) + prompt
        r = response + [PAD] * (8 - len(response))
        mask = [0] * (width - len(prompt)) + [1] * (len(prompt) + len(response))
        mask += [0] * (8 - len(response))
        self.batch = {
            "prompts": np.array(p),
            "responses": np.array(r),
            "attention_mask": np.array(mask),
        }
        self.non_tensor_batch = {"multi_modal_data": {"image": images}} if images else {}


class Data(list):  # type: ignore[type-arg]
    """A ``DataProto``'s items and its ``meta_info``."""

    def __init__(self, items: Any, meta_info: dict[str, Any] | None = None) -> None:
        super().__init__(items)
        self.meta_info = meta_info or {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_vlm(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=3)


@pytest.fixture
def served(checkpoint: Path, redis_url: str, key_prefix: str, cleanup_keys: None) -> Iterator[str]:
    ex = StatelessExecutor.from_pretrained(ExecutorConfig(dtype="float32"), str(checkpoint))
    with thread_worker(redis_url, key_prefix, ex):
        yield key_prefix


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _settings(redis_url: str, queue: str) -> dict[str, Any]:
    return {"redis_url": redis_url, "queue": queue, "wait_for_unknown_queue": True, "timeout_s": 60}


def test_verl_ref_log_prob_with_images_equals_the_plain_client(
    served: str, checkpoint: Path, redis_url: str
) -> None:
    from transformers import AutoImageProcessor

    from tests.support.vision import image_tokens

    processor = AutoImageProcessor.from_pretrained(checkpoint)
    na, nb = image_tokens(processor, _png(A)), image_tokens(processor, _png(B))
    group = [3, 4, *placeholder(na), 5, 6]  # one prompt, its image, three rollouts
    other = [7, *placeholder(nb), 8]
    text = [9, 10, 11]
    width = max(len(group), len(other))
    rows = [
        (group, [12, 13, 14], [A]), (group, [15, 16], [A]), (group, [17, 18, 19, 20], [A]),
        (other, [21, 22], [B]), (text, [23, 24, 25], []),
    ]  # fmt: skip
    data = Data((Item(p, r, i, width) for p, r, i in rows), {"temperature": 0.7})

    async def run() -> np.ndarray:
        try:
            return await ref_log_prob(data, **_settings(redis_url, served))
        finally:
            await close_all()

    got = asyncio.run(run())
    assert got.shape == (5, 8) and got.dtype == np.float32
    with ScoringClient(redis_url, queue=served, wait_for_unknown_queue=True) as client:
        for row, (prompt, response, images) in zip(got, rows, strict=True):
            seq = {"tokens": prompt + response, "prompt_len": len(prompt)}
            if images:
                seq["images"] = [0]
            (want,) = client.score([seq], temperature=0.7, images=images or None, timeout=60)
            np.testing.assert_allclose(row[: len(response)], want.logps, atol=1e-5, rtol=0)
            assert (row[len(response) :] == 0).all()
    # the five items went as one job carrying each distinct image once (A for the group)
    stream = keys.job_streams(served, 1)[0]
    field = protocol.PAYLOAD_FIELD
    (_, first), *_ = redis.Redis.from_url(redis_url).xrange(stream)
    job = msgpack.unpackb(first[field.encode() if isinstance(field, str) else field], raw=False)
    assert job["images"] == [_png(A), _png(B)]
    assert [s.get("images") for s in job["seqs"]] == [[0], [0], [0], [1], None]


def _plain_refusal(redis_url: str, queue: str, seq: dict[str, Any], images: list[Any]) -> Any:
    """The plain client's error for a reward job of ``seq`` with ``images``."""
    with (
        ScoringClient(redis_url, queue=queue, wait_for_unknown_queue=True) as client,
        pytest.raises(JobFailed) as caught,
    ):
        client.score([seq], mode="reward", images=images, timeout=60)
    return caught.value


def _jobs(redis_url: str, queue: str) -> list[dict[str, Any]]:
    """Every job added to ``queue``'s stream, decoded."""
    field = protocol.PAYLOAD_FIELD
    key = field.encode() if isinstance(field, str) else field
    entries = redis.Redis.from_url(redis_url).xrange(keys.job_streams(queue, 1)[0])
    return [msgpack.unpackb(fields[key], raw=False) for _, fields in entries]


def test_reward_forms_send_images_and_raise_what_the_plain_client_raises(
    served: str, redis_url: str
) -> None:
    """The verl manager and TRL's reward function send each sample's images with its sequence;
    this worker serves no reward model (images are scored in mode ``reference`` only), and the
    trainer gets the error the plain client gets for the same job."""
    prompt = [3, 4, *placeholder(6), 5]
    manager = ScoringRewardManager({}, None, **_settings(redis_url, served))
    trl = RewardFunction(redis_url, queue=served, wait_for_unknown_queue=True, timeout_s=60)

    async def run() -> tuple[Any, Any]:
        try:
            with pytest.raises(JobFailed) as verl_error:
                await manager.run_single([Item(prompt, [6, 7], [A], len(prompt))])
            with pytest.raises(JobFailed) as trl_error:
                await trl(["a picture: ", "text only: "], ["a cat", "a dog"], images=[[A], None])
            return verl_error.value, trl_error.value
        finally:
            await close_all()

    verl_error, trl_error = asyncio.run(run())
    jobs = _jobs(redis_url, served)
    verl_job, trl_job = jobs
    assert verl_job["images"] == [_png(A)] and verl_job["seqs"][0]["images"] == [0]
    assert trl_job["images"] == [_png(A)]
    assert [s.get("images") for s in trl_job["seqs"]] == [[0], None]
    seq = {"tokens": [*prompt, 6, 7], "prompt_len": 1, "images": [0]}
    want = _plain_refusal(redis_url, served, seq, [A])
    assert (verl_error.code, verl_error.reason) == (want.code, want.reason)
    assert (trl_error.code, trl_error.reason) == (want.code, want.reason)


def test_a_bad_form_is_a_clear_error(served: str, redis_url: str) -> None:
    prompt = [3, 4, *placeholder(6), 5]
    settings = _settings(redis_url, served)
    trl = RewardFunction(redis_url, queue=served, wait_for_unknown_queue=True, timeout_s=60)

    async def run() -> None:
        try:
            bad = Item(prompt, [6], [A], len(prompt))
            bad.non_tensor_batch = {"multi_modal_data": [A]}
            with pytest.raises(ValueError, match="multi_modal_data must be a dict"):
                await ref_log_prob(Data([bad]), **settings)
            with pytest.raises(ValueError, match="one entry per sample"):
                await trl(["p1", "p2"], ["c1", "c2"], image=[A])
            # prompt ids expanded for an image the item does not carry: the worker's reason
            with pytest.raises(BadRequestError, match="1 runs of the image token but 0 images"):
                await ref_log_prob(Data([Item(prompt, [6], [], len(prompt))]), **settings)
        finally:
            await close_all()

    asyncio.run(run())
