"""The Tinker sampling API on the gateway, driven by the unmodified ``tinker`` SDK (0.38.0):
``compute_logprobs``, top-k ``sample(max_tokens=1, include_prompt_logprobs=True,
topk_prompt_logprobs=k)`` and ``target_prompt_logprobs`` (dense and CSR) from a real worker,
equal to float64 references (transformers, the same tiny models) within 1e-4; ``tinker://``
names of adapters and versions; the user's errors raised without retry; and, without a worker,
the futures' idempotency, backpressure (429) and expiry (410), and the protobuf encoder read by
the SDK's own decoder.

The peer's code: ``tinker/lib/public_interfaces/sampling_client.py`` (``sample``,
``compute_logprobs``), ``tinker/lib/api_future_impl.py`` (``retrieve_future``),
``tinker/proto/response_conv.py`` (``deserialize_sample_response``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import torch

from tests.support.adapters import ADAPTERS, merged_float64, write_fleet
from tests.support.daemon import WorkerProc
from tests.support.gateway import GatewayThread
from tests.support.models import random_tokens, tiny_causal
from worker.gateway.errors import GatewayError
from worker.gateway.tinker import routes as tinker_routes
from worker.gateway.tinker.futures import FutureStore, Outcome
from worker.gateway.tinker.routes import session_id
from worker.gateway.tinker.wire import SampleAnswer, encode_sample_response

tinker = pytest.importorskip("tinker")
types = tinker.types

TOL = 1e-4
KEY = "tml-test-key"
PROMPTS = [random_tokens(n, seed=40 + n) for n in (7, 11, 16)]


def _logprobs(model: Any, ids: list[int]) -> np.ndarray:
    """``[len - 1, V]`` float64 log-probs; row i is the distribution of ids[i + 1]."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).numpy()


# -- the protobuf answer, read by the SDK's own decoder


def test_sample_response_encoding_is_what_the_sdk_decodes() -> None:
    from tinker.proto.response_conv import deserialize_sample_response

    rng = np.random.default_rng(0)
    lp = rng.normal(size=6).astype(np.float32)
    lp[0] = np.nan
    top_ids = rng.integers(0, 300, size=(6, 3)).astype(np.int32)
    top_lps = rng.normal(size=(6, 3)).astype(np.float32)
    top_ids[0], top_lps[0] = 0, -99999.0
    target = rng.normal(size=(5, 2)).astype(np.float32)
    crow, col = [0, 1, 1, 3, 3, 4], [1, 0, 1, 0]
    for csr in (None, (crow, col)):
        answer = SampleAnswer(3, lp, top_ids, top_lps, target, csr)
        got = deserialize_sample_response(encode_sample_response(answer))
        assert [s.stop_reason for s in got.sequences] == ["length"] * 3
        assert all(s.tokens == [] for s in got.sequences)
        np.testing.assert_array_equal(got.prompt_logprobs_np, lp)
        assert got.prompt_logprobs[0] is None
        np.testing.assert_array_equal(got.topk_prompt_logprobs_np.token_ids, top_ids)
        np.testing.assert_array_equal(got.topk_prompt_logprobs_np.logprobs, top_lps)
        assert got.topk_prompt_logprobs[0] is None and len(got.topk_prompt_logprobs[1]) == 3
        t = got.target_prompt_logprobs
        assert t.shape == [5, 2] and t.dtype == "float32"
        if csr is None:
            assert t.sparse_crow_indices is None
            np.testing.assert_array_equal(t.to_numpy(), target)
        else:
            assert (t.sparse_crow_indices, t.sparse_col_indices) == (crow, col)
            rows = [0, 2, 2, 4]
            np.testing.assert_array_equal(np.asarray(t.data), target[rows, col])
    bare = deserialize_sample_response(encode_sample_response(SampleAnswer(1)))
    assert bare.prompt_logprobs is None and bare.topk_prompt_logprobs is None
    assert bare.target_prompt_logprobs is None and len(bare.sequences) == 1


# -- a sample request as one scored sequence


def _request(tokens: list[int], **fields: Any) -> Any:
    from worker.gateway.tinker.wire import SampleRequest

    body = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
        "sampling_params": {"max_tokens": 1},
        **fields,
    }
    return SampleRequest.model_validate(body)


def test_plan_scores_from_the_first_position_asked() -> None:
    from worker.gateway.tinker.plan import SamplePlan

    tokens = list(range(1, 11))
    last = SamplePlan.of(_request(tokens, prompt_logprobs=True, prompt_logprobs_last_n=3))
    assert last.start == 7 and last.seq()["prompt_len"] == 7 and last.key(None, None).topk is None
    ids = [[-1, -1]] * 4 + [[5, -1]] + [[6, 7]] * 4
    target = {"data": [i for row in ids for i in row], "dtype": "int64", "shape": [9, 2]}
    plan = SamplePlan.of(_request(tokens, target_prompt_logprobs=target, topk_prompt_logprobs=2))
    assert plan.start == 1  # the top k wants every position
    only = SamplePlan.of(_request(tokens, target_prompt_logprobs=target))
    assert only.start == 5  # rows before the first named id are not scored
    gather = only.seq()["gather_ids"]
    assert gather.shape == (5, 2) and gather[0].tolist() == [5, 0]  # -1 travels as id 0
    assert only.key(None, None).gather_width == 2
    assert SamplePlan.of(_request([7], prompt_logprobs=True)).start == 0  # nothing to score


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"sampling_params": {"max_tokens": 2}}, "max_tokens=2"),
        ({"sampling_params": {}}, "max_tokens=None"),
        ({"prompt_alt_tokens_k": 1}, "sampling"),
        ({"topk_prompt_logprobs": -1}, ">= 0"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 4}, "last_n"),
        ({"target_prompt_logprobs": {"data": [1, 2], "dtype": "int64", "shape": [1, 2]}}, "shape"),
        (
            {"target_prompt_logprobs": {"data": [-1] * 6, "dtype": "int64", "shape": [3, 2]}},
            "no id",
        ),
        (
            {
                "target_prompt_logprobs": {
                    "data": [5],
                    "dtype": "int64",
                    "shape": [3, 2],
                    "sparse_crow_indices": [0, 1, 1],
                    "sparse_col_indices": [0],
                }
            },
            "CSR",
        ),
    ],
)
def test_plan_refuses_what_is_not_served(fields: dict[str, Any], why: str) -> None:
    from worker.gateway.tinker.plan import SamplePlan

    body = {"sampling_params": {"max_tokens": 1}, **fields}
    with pytest.raises(GatewayError) as refused:
        SamplePlan.of(_request([1, 2, 3, 4], **body))
    assert refused.value.code == "bad_request" and why in refused.value.message


# -- the futures: idempotent, bounded, expiring


def test_futures_are_idempotent_bounded_and_expire() -> None:
    async def scenario() -> None:
        store = FutureStore(max_pending=2, ttl_s=0.2)
        started: list[str] = []
        gate = asyncio.Event()

        def job(name: str) -> Any:
            async def run() -> bytes:
                started.append(name)
                await gate.wait()
                return name.encode()

            return run

        assert store.submit("s/1", job("a"))
        assert not store.submit("s/1", job("again"))  # the same (session, seq_id): no new job
        assert store.submit("s/2", job("b"))
        with pytest.raises(GatewayError) as full:
            store.submit("s/3", job("c"))
        assert full.value.code == "rate_limited"
        assert await store.wait("s/1", 0.05) is None  # still running: try again
        gate.set()
        assert await store.wait("s/1", 1.0) == Outcome(body=b"a")
        assert store.submit("s/3", job("c"))  # a retrieved answer no longer counts
        await asyncio.sleep(0.01)
        assert sorted(started) == ["a", "b", "c"]
        assert await store.wait("s/1", 1.0) == Outcome(body=b"a")  # a retried retrieval
        assert store.pending == 2  # s/2 and s/3 answered, not retrieved
        await asyncio.sleep(1.1)  # past the TTL of s/2 and s/3 (answered, never retrieved)
        with pytest.raises(GatewayError) as gone:
            await store.wait("s/2", 0.1)
        assert gone.value.code == "result_gone"
        assert store.pending == 0 and len(store) == 0
        gate.clear()
        assert store.submit("s/4", job("d"))
        assert store.cancel("s/4") and not store.cancel("s/4")  # an abandoned poll
        assert store.pending == 0
        await store.close()

    asyncio.run(scenario())


@pytest.mark.redis
@pytest.mark.timeout(60)
def test_asample_without_a_worker_is_idempotent_and_backs_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No worker serves the queue (and none is required): jobs stay pending. The same
    ``(sampling_session_id, seq_id)`` twice is one job; past the limit, 429; an unknown future,
    410; the key may come as ``X-API-Key``."""
    from tests.conftest import MACHINE_REDIS_URL

    queue = f"tk{uuid.uuid4().hex[:8]}"
    with GatewayThread(
        MACHINE_REDIS_URL,
        queue,
        api_key=KEY,
        allow_unknown_queue=True,
        tinker_max_pending=2,
        timeout_s=5,
    ) as g:
        headers = {"X-API-Key": KEY}
        session = session_id(None, None)

        def sample(seq_id: int) -> requests.Response:
            body = {
                "sampling_session_id": session,
                "seq_id": seq_id,
                "num_samples": 2,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                "sampling_params": {"max_tokens": 1},
                "prompt_logprobs": True,
            }
            return requests.post(f"{g.url}/api/v1/asample", json=body, headers=headers, timeout=10)

        first = sample(1)
        assert first.status_code == 200, first.text
        assert len(first.json()["sample_sequence_ids"]) == 2
        assert sample(1).json() == first.json()
        assert sample(2).status_code == 200
        time.sleep(0.2)
        sent = g.core.metrics.registry.get_sample_value(
            "scoring_gateway_sequences_total", {"route": "/api/v1/asample"}
        )
        assert sent == 2  # seq 1 once, seq 2 once
        assert sample(3).status_code == 429
        monkeypatch.setattr(tinker_routes, "LONG_POLL_S", 0.2)
        poll = requests.post(
            f"{g.url}/api/v1/retrieve_future",
            json={"request_id": first.json()["request_id"]},
            headers=headers,
            timeout=30,
        )
        assert poll.json()["type"] == "try_again"  # the job waits for a worker: poll again
        gone = requests.post(
            f"{g.url}/api/v1/retrieve_future",
            json={"request_id": "nope"},
            headers=headers,
            timeout=30,
        )
        assert gone.status_code == 410
        assert requests.post(f"{g.url}/api/v1/asample", json={}, timeout=10).status_code == 401
        wrong = {"X-API-Key": "tml-wrong"}
        response = requests.post(f"{g.url}/api/v1/asample", json={}, headers=wrong, timeout=10)
        assert response.status_code == 401


# -- the SDK against a real worker


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayThread, Path]]:
    from tests.conftest import MACHINE_REDIS_URL

    root = tmp_path_factory.mktemp("tinker")
    paths = write_fleet(root, versions=2)
    queue = f"tinker{uuid.uuid4().hex[:8]}"
    worker = WorkerProc(
        [
            "--redis-url", MACHINE_REDIS_URL, "--queue", queue, "--consumer", "w1",
            "--device", "cpu", "--reference-model", str(paths["base"]),
            "--adapter-root", str(paths["adapters"]), "--model-root", str(paths["models"]),
            "--metrics-port", "0", "--max-topk", "16",
        ],
        root / "worker.log",
    )  # fmt: skip
    try:
        worker.wait_ready(120)
        with GatewayThread(MACHINE_REDIS_URL, queue, api_key=KEY, model_name="tiny-teacher") as g:
            yield g, paths["adapters"]
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def service(fleet: tuple[GatewayThread, Path]) -> Iterator[Any]:
    client = tinker.ServiceClient(base_url=fleet[0].url, api_key=KEY)
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def teacher(service: Any) -> Any:
    return service.create_sampling_client(base_model="tiny-teacher").result()


@pytest.fixture(scope="module")
def base_f64() -> Any:
    return tiny_causal("llama", seed=0).double().eval()


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_compute_logprobs_and_last_n(teacher: Any, base_f64: Any) -> None:
    for ids in PROMPTS:
        lp = _logprobs(base_f64, ids)
        want = [lp[p - 1, ids[p]] for p in range(1, len(ids))]
        got = teacher.compute_logprobs(types.ModelInput.from_ints(ids)).result()
        assert got[0] is None and len(got) == len(ids)
        np.testing.assert_allclose(got[1:], want, atol=TOL)
        tail = teacher.compute_logprobs(
            types.ModelInput.from_ints(ids), prompt_logprobs_last_n=3
        ).result()
        assert all(x is None for x in tail[:-3])
        np.testing.assert_allclose(tail[-3:], want[-3:], atol=TOL)


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_topk_prompt_logprobs_as_distillation_asks(teacher: Any, base_f64: Any) -> None:
    """tinker-cookbook's off-policy distillation call: max_tokens=1, prompt log-probs and the
    top k at every position; ``num_samples`` sequences come back, with no tokens."""
    k = 5
    futures = [
        teacher.sample(
            prompt=types.ModelInput.from_ints(ids),
            num_samples=2,
            sampling_params=types.SamplingParams(max_tokens=1),
            include_prompt_logprobs=True,
            topk_prompt_logprobs=k,
        )
        for ids in PROMPTS
    ]
    for ids, future in zip(PROMPTS, futures, strict=True):
        response = future.result()
        assert len(response.sequences) == 2 and all(s.tokens == [] for s in response.sequences)
        assert len({s.sequence_id for s in response.sequences}) == 2
        lp = _logprobs(base_f64, ids)
        top = response.topk_prompt_logprobs
        assert top[0] is None and len(top) == len(ids)
        for p in range(1, len(ids)):
            row = lp[p - 1]
            order = np.argsort(-row)[:k]
            assert [t for t, _ in top[p]] == order.tolist()
            np.testing.assert_allclose([v for _, v in top[p]], row[order], atol=TOL)
            assert response.prompt_logprobs[p] == pytest.approx(row[ids[p]], abs=TOL)


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sparse", [False, True])
def test_target_prompt_logprobs_dense_and_csr(teacher: Any, base_f64: Any, sparse: bool) -> None:
    """The teacher at ids the student chose, per position; -1 asks nothing (0.0 back); rows
    before the first named id are not scored; the answer keeps the request's layout."""
    ids = PROMPTS[2]
    n, k = len(ids), 3
    gen = torch.Generator().manual_seed(7)
    target = torch.randint(0, 96, (n - 1, k), generator=gen)
    target[:4] = -1  # nothing asked before position 5
    target[6, 1:] = -1
    target[9, 0] = -1
    if sparse:  # a few cells only (as a student's chosen ids at some positions)
        keep = torch.zeros_like(target, dtype=torch.bool)
        keep[[5, 7, 7, 12, 14], [0, 1, 2, 0, 2]] = True
        target[~keep] = -1
    td = (
        types.TensorData.from_torch_sparse(target, pad_value=-1)
        if sparse
        else types.TensorData.from_torch(target)
    )
    assert (td.sparse_crow_indices is not None) == sparse
    response = teacher.sample(
        prompt=types.ModelInput.from_ints(ids),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        target_prompt_logprobs=td,
    ).result()
    got = response.target_prompt_logprobs
    assert (got.sparse_crow_indices is not None) == sparse and got.shape == [n - 1, k]
    dense = got.to_numpy()
    lp = _logprobs(base_f64, ids)
    t = target.numpy()
    want = np.where(t >= 0, np.take_along_axis(lp, np.maximum(t, 0), axis=1), 0.0)
    np.testing.assert_allclose(dense, want, atol=TOL)
    assert response.prompt_logprobs[1] == pytest.approx(lp[0, ids[1]], abs=TOL)


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_model_path_names_adapters_and_versions(
    service: Any, fleet: tuple[GatewayThread, Path], base_f64: Any
) -> None:
    ids = PROMPTS[1]
    refs = {
        f"tinker://{ADAPTERS[0]}": merged_float64(base_f64, fleet[1] / ADAPTERS[0]),
        f"tinker://adapter:{ADAPTERS[2]}": merged_float64(base_f64, fleet[1] / ADAPTERS[2]),
        "tinker://version:step-1": tiny_causal("llama", seed=11).double().eval(),
    }
    for path, ref in refs.items():
        client = service.create_sampling_client(model_path=path).result()
        assert client.get_base_model() == "tiny-teacher"  # read back from GET samplers/{id}
        got = client.compute_logprobs(types.ModelInput.from_ints(ids)).result()
        lp = _logprobs(ref, ids)
        np.testing.assert_allclose(
            got[1:], [lp[p - 1, ids[p]] for p in range(1, len(ids))], atol=TOL
        )


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_user_errors_raise_without_retry(service: Any, teacher: Any) -> None:
    from tinker import RequestFailedError

    prompt = types.ModelInput.from_ints(PROMPTS[0])
    cases = [
        dict(sampling_params=types.SamplingParams(max_tokens=8)),  # generation
        dict(sampling_params=types.SamplingParams(max_tokens=1), topk_prompt_logprobs=999),
        dict(
            sampling_params=types.SamplingParams(max_tokens=1),
            prompt_alt_tokens_k=2,
        ),
    ]
    for extra in cases:
        with pytest.raises(RequestFailedError) as failed:
            teacher.sample(prompt=prompt, num_samples=1, **extra).result(timeout=60)
        assert failed.value.category == types.RequestErrorCategory.User
    image = types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=[1, 2]),
            types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4),
        ]
    )
    with pytest.raises(RequestFailedError) as failed:
        teacher.compute_logprobs(image).result(timeout=60)
    assert "image" in str(failed.value)
    missing = service.create_sampling_client(model_path="tinker://adapter:nope").result()
    with pytest.raises(RequestFailedError) as failed:
        missing.compute_logprobs(prompt).result(timeout=60)
    assert failed.value.category == types.RequestErrorCategory.User
    with pytest.raises(tinker.NotFoundError):
        service.create_sampling_client(base_model="Qwen/Qwen3-8B").result()


@pytest.mark.redis
@pytest.mark.timeout(60)
def test_asample_on_a_queue_nobody_ever_served_is_refused_at_once() -> None:
    """The queue rule on the Tinker route: 503 ``unknown_queue`` before any job or future."""
    from tests.conftest import MACHINE_REDIS_URL

    queue = f"tk{uuid.uuid4().hex[:8]}"
    with GatewayThread(MACHINE_REDIS_URL, queue, api_key=KEY, timeout_s=5) as g:
        body = {
            "sampling_session_id": session_id(None, None),
            "seq_id": 1,
            "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {"max_tokens": 1},
            "prompt_logprobs": True,
        }
        got = requests.post(
            f"{g.url}/api/v1/asample", json=body, headers={"X-API-Key": KEY}, timeout=10
        )
        assert got.status_code == 503, got.text
        assert got.json()["error"]["code"] == "unknown_queue"
        assert not g.core.metrics.registry.get_sample_value(
            "scoring_gateway_sequences_total", {"route": "/api/v1/asample"}
        )
