"""Tinker image chunks through the gateway and a real worker (real Redis, a tiny Qwen2-VL with
its image processor, the daemon in a thread, the gateway on a loopback port): a prompt whose
``ImageChunk`` expands to its ``expected_tokens`` answers the prompt log-probs the plain client
gets for the same job (the image's file sent with it, image-token positions unscored); a count
the worker's processor does not make, a chunk without ``expected_tokens``, bytes that are not
the declared format, an asset pointer and an image chunk on a gateway without an image token are
each the SDK's user error naming why. Requests are the SDK's JSON (``ImageChunk`` serialises
``data`` as base64), answers read from the protobuf ``SampleResponse``; the unmodified
``tinker`` SDK builds and reads the same through ``compute_logprobs``."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import transformers

from tests.support.daemon import thread_worker
from tests.support.gateway import GatewayThread
from tests.support.vision import END, IMAGE, START, image_file, image_tokens
from worker.client import ScoringClient
from worker.demo.tiny import save_tiny_vlm
from worker.executor import ExecutorConfig, StatelessExecutor
from worker.gateway.tinker import routes

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]

PNG = image_file(90, 60, seed=1)
JPEG = image_file(50, 100, seed=2, fmt="JPEG")


def _varint(buf: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at


def prompt_logprobs_of(message: bytes) -> np.ndarray:
    """Field 2 (``prompt_logprobs``, float32 bytes) of a ``SampleResponse``."""
    at = 0
    while at < len(message):
        tag, at = _varint(message, at)
        field, kind = tag >> 3, tag & 7
        if kind == 0:
            _, at = _varint(message, at)
            continue
        assert kind == 2, f"wire type {kind}"
        size, at = _varint(message, at)
        if field == 2:
            return np.frombuffer(message[at : at + size], dtype="<f4")
        at += size
    raise AssertionError("no prompt_logprobs in the answer")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_vlm(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", seed=3)


@pytest.fixture
def fleet(
    checkpoint: Path, redis_url: str, key_prefix: str, cleanup_keys: None
) -> Iterator[GatewayThread]:
    ex = StatelessExecutor.from_pretrained(ExecutorConfig(dtype="float32"), str(checkpoint))
    with (
        thread_worker(redis_url, key_prefix, ex),
        GatewayThread(redis_url, key_prefix, image_token_id=IMAGE, timeout_s=60) as g,
    ):
        yield g


def _image(data: bytes, fmt: str, n: int | None) -> dict[str, Any]:
    chunk = {"type": "image", "data": base64.b64encode(data).decode(), "format": fmt}
    return chunk if n is None else {**chunk, "expected_tokens": n}


def _sample(g: GatewayThread, chunks: list[dict[str, Any]]) -> requests.Response:
    """One ``asample`` (max_tokens 1, prompt log-probs) and its future's answer."""
    body = {
        "num_samples": 1,
        "prompt": {"chunks": chunks},
        "sampling_params": {"max_tokens": 1},
        "prompt_logprobs": True,
    }
    started = requests.post(f"{g.url}/api/v1/asample", json=body, timeout=30)
    assert started.status_code == 200, started.text
    rid = started.json()["request_id"]
    for _ in range(20):
        got = requests.post(f"{g.url}/api/v1/retrieve_future", json={"request_id": rid}, timeout=90)
        if (
            got.headers["content-type"] != "application/json"
            or got.json().get("type") != "try_again"
        ):
            return got
    raise AssertionError("no answer")


def _text(ids: list[int]) -> dict[str, Any]:
    return {"type": "encoded_text", "tokens": ids}


def test_image_chunks_score_as_the_plain_client_job(
    fleet: GatewayThread, checkpoint: Path, redis_url: str, key_prefix: str
) -> None:
    processor = transformers.AutoImageProcessor.from_pretrained(checkpoint)
    na, nb = image_tokens(processor, PNG), image_tokens(processor, JPEG)
    chunks = [
        _text([3, 4, START]), _image(PNG, "png", na), _text([END, 5, 6, START]),
        _image(JPEG, "jpeg", nb), _text([END, 7, 8, 9]),
    ]  # fmt: skip
    got = _sample(fleet, chunks)
    assert got.headers["content-type"] == routes.PROTOBUF, got.text
    lp = prompt_logprobs_of(got.content)
    tokens = [3, 4, START, *[IMAGE] * na, END, 5, 6, START, *[IMAGE] * nb, END, 7, 8, 9]
    assert lp.shape == (len(tokens),)
    with ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True) as client:
        (want,) = client.score(
            [{"tokens": tokens, "prompt_len": 1, "images": [0, 1]}], images=[PNG, JPEG], timeout=60
        )
    text_at = [p for p in range(1, len(tokens)) if tokens[p] != IMAGE]
    np.testing.assert_array_equal(lp[text_at], np.asarray(want.logps, dtype=np.float32))
    assert np.isnan(lp[0]) and np.isnan(lp[[p for p, t in enumerate(tokens) if t == IMAGE]]).all()
    assert np.isfinite(lp[text_at]).all()


@pytest.mark.parametrize(
    ("chunk", "why"),
    [
        (lambda n: _image(PNG, "png", n + 1), "has {m} image tokens but the processor makes {n}"),
        (lambda n: _image(PNG, "png", None), "expected_tokens is required"),
        (lambda n: _image(PNG, "jpeg", n), "is not a jpeg file"),
        (lambda n: {**_image(PNG, "png", n), "data": "%%%"}, "not base64"),
        (
            lambda n: {"type": "image_asset_pointer", "location": "s3://x", "format": "png"},
            "never fetched",
        ),
    ],
)
def test_a_bad_image_chunk_is_the_users_error(
    fleet: GatewayThread, checkpoint: Path, chunk: Any, why: str
) -> None:
    processor = transformers.AutoImageProcessor.from_pretrained(checkpoint)
    n = image_tokens(processor, PNG)
    got = _sample(fleet, [_text([3, 4, START]), chunk(n), _text([END, 5, 6])])
    body = got.json()
    assert body["category"] == "user", body
    assert body["error"].startswith("[bad_request]"), body
    assert why.format(n=n, m=n + 1) in body["error"], body


def test_an_image_chunk_needs_the_gateways_image_token(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    with GatewayThread(redis_url, key_prefix, allow_unknown_queue=True, timeout_s=5) as g:
        got = _sample(g, [_text([3, START]), _image(PNG, "png", 6), _text([END])])
    assert got.json()["category"] == "user"
    assert "--image-token-id" in got.json()["error"]


def test_the_tinker_sdk_sends_image_chunks_and_reads_the_answer(
    checkpoint: Path, redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    """The unmodified SDK: ``compute_logprobs`` of a ``ModelInput`` with an ``ImageChunk``
    (its own JSON and protobuf decoding) gives the plain client's log-probs, ``None`` at image
    tokens; a wrong ``expected_tokens`` raises its ``RequestFailedError`` naming both counts."""
    tinker = pytest.importorskip("tinker")
    types = tinker.types
    processor = transformers.AutoImageProcessor.from_pretrained(checkpoint)
    n = image_tokens(processor, PNG)
    ex = StatelessExecutor.from_pretrained(ExecutorConfig(dtype="float32"), str(checkpoint))
    key = "tml-images-key"
    with (
        thread_worker(redis_url, key_prefix, ex),
        GatewayThread(redis_url, key_prefix, api_key=key, image_token_id=IMAGE) as g,
    ):
        service = tinker.ServiceClient(base_url=g.url, api_key=key)
        try:
            teacher = service.create_sampling_client(model_path="tinker://").result()

            def prompt(count: int) -> Any:
                return types.ModelInput(
                    chunks=[
                        types.EncodedTextChunk(tokens=[3, 4, START]),
                        types.ImageChunk(data=PNG, format="png", expected_tokens=count),
                        types.EncodedTextChunk(tokens=[END, 5, 6, 7]),
                    ]
                )

            got = teacher.compute_logprobs(prompt(n)).result()
            with pytest.raises(tinker.RequestFailedError, match=f"{n + 1} image tokens"):
                teacher.compute_logprobs(prompt(n + 1)).result()
        finally:
            service.close("success").result()
        tokens = [3, 4, START, *[IMAGE] * n, END, 5, 6, 7]
        with ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True) as client:
            (want,) = client.score(
                [{"tokens": tokens, "prompt_len": 1, "images": [0]}], images=[PNG], timeout=60
            )
    assert len(got) == len(tokens) and got[0] is None
    text_at = [p for p in range(1, len(tokens)) if tokens[p] != IMAGE]
    assert all(got[p] is None for p, t in enumerate(tokens) if t == IMAGE)
    np.testing.assert_allclose([got[p] for p in text_at], want.logps, atol=1e-6, rtol=0)
