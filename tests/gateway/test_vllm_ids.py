"""vLLM's teacher log-probs at chosen ids on ``/inference/v1/generate``
(``sampling_params.prompt_logprob_token_ids`` / ``prompt_logprob_start``, answered
``prompt_token_id_logprobs``), parsed the way vLLM's ``docs/training/prompt_token_id_logprobs.md``
says a client does (``np.load(io.BytesIO(base64.b64decode(...)))``), against float64 references
from the same tiny model: a real worker, a real gateway, real HTTP."""

from __future__ import annotations

import base64
import io
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import requests
import torch

from tests.support.daemon import WorkerProc
from tests.support.gateway import GatewayThread
from tests.support.models import random_tokens, tiny_causal

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(240)]

TOL = 1e-4
IDS = random_tokens(14, seed=9)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayThread, Any]]:
    from tests.conftest import MACHINE_REDIS_URL

    root = tmp_path_factory.mktemp("ids")
    model = tiny_causal("llama", seed=3)
    model.save_pretrained(root / "ref")
    queue = f"ids{uuid.uuid4().hex[:8]}"
    worker = WorkerProc(
        [
            "--redis-url", MACHINE_REDIS_URL, "--queue", queue, "--consumer", "w1",
            "--reference-model", str(root / "ref"), "--device", "cpu", "--metrics-port", "0",
        ],
        root / "worker.log",
    )  # fmt: skip
    try:
        worker.wait_ready(120)
        with GatewayThread(MACHINE_REDIS_URL, queue, model_name="tiny-teacher") as g:
            yield g, model.double().eval()
    finally:
        worker.stop()


def _logprobs(model: Any, ids: list[int]) -> np.ndarray:
    """``[len - 1, V]`` float64; row i is the distribution of ids[i + 1]."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).numpy()


def _generate(g: GatewayThread, params: dict[str, Any]) -> requests.Response:
    body = {"model": "tiny-teacher", "token_ids": IDS, "sampling_params": params}
    return requests.post(f"{g.url}/inference/v1/generate", json=body, timeout=60)


def _matrix(answer: dict[str, Any]) -> np.ndarray:
    """As vLLM's doc parses it."""
    return np.load(io.BytesIO(base64.b64decode(answer["prompt_token_id_logprobs"])))


def test_one_candidate_set_for_every_row(served: tuple[GatewayThread, Any]) -> None:
    g, ref = served
    candidates, start = [5, 17, 3, 60], 8
    answer = _generate(
        g,
        {
            "max_tokens": 1,
            "prompt_logprob_token_ids": candidates,
            "prompt_logprob_start": start,
        },
    ).json()
    scores = _matrix(answer)
    assert scores.dtype == np.float32 and scores.shape == (len(IDS) - 1 - start, 4)
    lp = _logprobs(ref, IDS)
    for i in range(scores.shape[0]):  # row i scores token start + i + 1
        np.testing.assert_allclose(scores[i], lp[start + i, candidates], atol=TOL)
    assert answer["prompt_logprobs"] is None  # not asked


def test_per_row_candidates_beside_prompt_logprobs(served: tuple[GatewayThread, Any]) -> None:
    """slime's per-position form (one list per scored row, a shorter row padded with -1 and
    answered -inf), with ``prompt_logprobs`` asked as well: both from one job."""
    g, ref = served
    response_length = 5
    start = len(IDS) - response_length - 1
    rows = [[IDS[start + i + 1], 7, 8][: 3 - (i == 2)] for i in range(response_length)]
    answer = _generate(
        g,
        {
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 2,
            "prompt_logprob_token_ids": rows,
            "prompt_logprob_start": start,
        },
    ).json()
    scores = _matrix(answer)
    lp = _logprobs(ref, IDS)
    assert scores.shape == (response_length, 3)
    for i, row in enumerate(rows):
        np.testing.assert_allclose(scores[i, : len(row)], lp[start + i, row], atol=TOL)
    assert scores[2, 2] == -np.inf
    entries = answer["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(IDS)
    for p in range(1, len(IDS)):
        first = next(iter(entries[p].values()))
        assert first["logprob"] == pytest.approx(lp[p - 1, IDS[p]], abs=TOL)


def test_rows_that_do_not_fit_are_a_400(served: tuple[GatewayThread, Any]) -> None:
    g, _ = served
    bad = _generate(
        g, {"max_tokens": 1, "prompt_logprob_token_ids": [[1], [2]], "prompt_logprob_start": 3}
    )
    assert bad.status_code == 400 and "rows" in bad.json()["error"]["message"]
    none = _generate(g, {"max_tokens": 1})
    assert none.status_code == 400
