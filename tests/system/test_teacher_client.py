"""What a distillation trainer holds in its hands: ``hidden`` rows as torch tensors of the
dtype it asked (``worker.tensors``; bfloat16 bit for bit the worker's own rows), ``hidden_dtype``
and ``max_result_bytes`` as named arguments of ``score``, ``score_many`` (call-wide, ``JobSpec``
and job maps) and ``score_cross_tokenizer`` in both clients, checked before anything is sent,
and what a student-text job refuses (a prefix, a mode, per-sequence gather ids). Through a real
worker (this process, the machine's Redis) serving a tiny Llama with the demo's byte tokenizer."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.daemon import thread_worker
from tests.support.models import random_tokens
from worker.client import BadRequestError, JobSpec, ScoringClient, TooLargeError
from worker.client.aio import AsyncScoringClient
from worker.client.results import SeqScore
from worker.demo.tiny import byte_tokenizer, llama_config, random_model
from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
from worker.request import ScoreOptions, TokenOutputs
from worker.tensors import hidden_tensor, hidden_tensors

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[2]
DTYPES = ("bfloat16", "float16", "float32")


@pytest.fixture(scope="module")
def executor() -> StatelessExecutor:
    tokenizer = byte_tokenizer()
    model = random_model("LlamaForCausalLM", llama_config(len(tokenizer), 32, 64, 256), 0)
    return StatelessExecutor(ExecutorConfig(), model, tokenizers=(tokenizer, None))


def _seqs() -> list[dict[str, Any]]:
    return [
        {"tokens": random_tokens(18 + 5 * i, 40 + i, vocab=259), "prompt_len": 4 + i}
        for i in range(2)
    ]


def _own_rows(executor: StatelessExecutor, dtype: str) -> list[np.ndarray]:
    """The executor's own rows for ``_seqs()`` (bfloat16 as its uint16 bits), in process."""
    spec = TokenOutputs(frozenset({"hidden"}), hidden_dtype=dtype)
    seqs = [SequenceInput(s["tokens"], s["prompt_len"]) for s in _seqs()]
    out = executor.score(seqs, mode="reference", options=ScoreOptions(outputs=spec))
    return [s.arrays["hidden"] for s in out.scores]


@pytest.mark.timeout(180)
def test_hidden_tensors_are_the_workers_rows_bit_for_bit_in_the_dtype_asked(
    redis_url: str, key_prefix: str, cleanup_keys: None, executor: StatelessExecutor
) -> None:
    with (
        thread_worker(redis_url, key_prefix, executor),
        ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True) as client,
    ):
        got = {d: client.score(_seqs(), outputs=("hidden",), hidden_dtype=d) for d in DTYPES}
    for dtype, scores in got.items():
        own = _own_rows(executor, dtype)
        for seq, tensor, want in zip(scores, hidden_tensors(scores), own, strict=True):
            assert tensor.dtype == getattr(torch, dtype) and tensor.shape == want.shape
            if dtype == "bfloat16":  # the very bits the worker computed
                bits = tensor.view(torch.int16).numpy().view(np.uint16)
                np.testing.assert_array_equal(bits, want)
                np.testing.assert_array_equal(seq.hidden_bits, want)
                np.testing.assert_array_equal(tensor.float().numpy(), seq.hidden)
            else:
                assert want.dtype == np.dtype(dtype)
                np.testing.assert_array_equal(tensor.numpy(), want)
            before = np.array(seq.hidden)
            tensor.fill_(7.0)  # writable, and its own memory: the result is left as it was
            np.testing.assert_array_equal(seq.hidden, before)
    with pytest.raises(ValueError, match="no hidden rows"):
        hidden_tensor(SeqScore())


@pytest.mark.timeout(180)
def test_hidden_dtype_and_max_result_bytes_are_named_arguments_everywhere(
    redis_url: str, key_prefix: str, cleanup_keys: None, executor: StatelessExecutor
) -> None:
    seqs = _seqs()
    jobs: list[Any] = [
        seqs,  # takes every default: hidden in float16, the call's limit (fits)
        JobSpec(seqs, outputs=("logps", "hidden"), hidden_dtype="float32", job_id="own"),
        JobSpec(seqs, outputs=("hidden",), max_result_bytes=100, job_id="small"),
        {"seqs": seqs, "outputs": ["hidden"], "hidden_dtype": "bfloat16", "id": "map"},
        {"seqs": seqs, "max_result_bytes": 10, "id": "map-small"},  # the call's outputs
    ]
    students = [{"prompt": "<s>Q: sky?\nA:", "tokens": [" The", " sky", " is", " blue"]}]
    with (
        thread_worker(redis_url, key_prefix, executor),
        ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True) as client,
    ):
        out = list(client.score_many(jobs, outputs=("hidden",), hidden_dtype="float16",
                                     max_result_bytes=1 << 20, raise_errors=False))  # fmt: skip
        (plain,) = list(client.score_many([seqs], max_result_bytes=10, raise_errors=False))
        (student,) = client.score_cross_tokenizer(
            students, outputs=("logps", "hidden"), hidden_dtype="float32", timeout=60
        )
        with pytest.raises(TooLargeError, match="max_result_bytes of 64"):
            client.score_cross_tokenizer(students, max_result_bytes=64, timeout=60)
        with pytest.raises(TooLargeError, match="max_result_bytes of 50"):
            client.score(seqs, outputs=("logps", "hidden"), max_result_bytes=50, timeout=60)

        async def _async() -> tuple[Any, Any]:
            async with AsyncScoringClient(redis_url, queue=key_prefix) as aclient:
                one = await aclient.score(seqs, outputs=("hidden",), hidden_dtype="float16")
                many = [r async for r in aclient.score_many(
                    [seqs], max_result_bytes=10, raise_errors=False)]  # fmt: skip
                return one, many

        aone, (amany,) = asyncio.run(_async())
    first, own, small, mapped, map_small = out
    assert [s.hidden_dtype for s in first] == ["float16"] * 2 and first[0].logps is None
    assert own[0].hidden.dtype == np.float32 and own[0].logps is not None
    assert isinstance(small, TooLargeError) and "max_result_bytes of 100" in str(small)
    assert mapped[0].hidden_dtype == "bfloat16" and mapped[0].hidden_bits.dtype == np.uint16
    assert isinstance(map_small, TooLargeError) and "max_result_bytes of 10" in str(map_small)
    assert isinstance(plain, TooLargeError) and "max_result_bytes of 10" in str(plain)
    assert isinstance(amany, TooLargeError) and aone[0].hidden.dtype == np.float16
    assert student.hidden.shape == (len(student.logps), 32) and student.hidden_dtype == "float32"
    assert hidden_tensor(student).dtype == torch.float32


@pytest.mark.timeout(60)
def test_bad_settings_and_student_refusals_are_clear_before_anything_is_sent(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    seqs = _seqs()
    view = {"prompt": "Q:", "tokens": [" a", " b"]}
    with ScoringClient(redis_url, queue=key_prefix, wait_for_unknown_queue=True) as client:
        bad: list[tuple[Any, str]] = [
            (lambda: client.submit(seqs, outputs=("hidden",), hidden_dtype="bf16"),
             "hidden_dtype must be one of"),
            (lambda: client.submit(seqs, hidden_dtype="float32"),
             "'hidden' is not a requested output"),
            (lambda: client.submit(seqs, outputs=("logps",), hidden_dtype="bfloat16"),
             "'hidden' is not a requested output"),
            (lambda: client.submit(seqs, max_result_bytes=-1),
             "max_result_bytes must be an integer in 0.."),
            (lambda: client.submit(seqs, max_result_bytes=True),
             "max_result_bytes must be an integer in 0.."),
            (lambda: list(client.score_many([JobSpec(seqs, max_result_bytes=1.5)])),
             "max_result_bytes must be an integer"),
            (lambda: client.score_cross_tokenizer([view], prefix=[1, 2]),
             "takes no prefix: a prefix is token ids"),
            (lambda: client.score_cross_tokenizer([view], mode="both"),
             "takes no mode: student text is scored in mode reference"),
            (lambda: client.score_cross_tokenizer([{**view, "gather_ids": [[1], [2]]}]),
             "no per-sequence gather_ids"),
            (lambda: client.score([{"student": view}], "both"),
             "student sequences are scored in mode reference"),
            (lambda: client.score([{"student": view}], prefix=[5]),
             "a student-text sequence takes no prefix"),
        ]  # fmt: skip
        for call, message in bad:
            with pytest.raises(BadRequestError, match=message) as refused:
                call()
            assert refused.value.sent is False
        assert client.redis.xlen(client.job_streams[0]) == 0


def test_without_torch_the_tensor_helpers_say_so_and_importing_them_loads_nothing() -> None:
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ImportError("torch is blocked")
sys.meta_path.insert(0, Block())
import worker.tensors
assert "numpy" not in sys.modules and "torch" not in sys.modules
import numpy as np
from worker.client.results import SeqScore
seq = SeqScore(hidden=np.zeros((2, 4), np.float32), hidden_dtype="float32")
try:
    worker.tensors.hidden_tensor(seq)
except ImportError as exc:
    assert "needs torch (pip install torch)" in str(exc), exc
    print("refused")
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "refused", proc.stderr


@pytest.mark.timeout(180)
def test_enqueue_takes_hidden_rows_their_dtype_a_result_limit_and_student_text(
    redis_url: str,
    key_prefix: str,
    cleanup_keys: None,
    executor: StatelessExecutor,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from worker.cli import main

    seq = _seqs()[0]
    student = {"prompt": "<s>Q: sky?\nA:", "tokens": [" The", " sky", " is", " blue"]}
    lines = [
        {"id": "ids", **seq, "mode": "reference"},
        {"id": "text", "student": student},  # mode reference, though --mode says both
        {"id": "texts", "seqs": [{"student": student}] * 2},
        {
            "id": "small",
            **seq,
            "mode": "reference",
            "max_result_bytes": 64,
        },  # its own limit: too_large
        {"id": "bad", **seq, "max_result_bytes": -1},  # refused before sending
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    common = ["enqueue", "--no-progress", "--wait-for-workers", "30", "--redis-url", redis_url,
              "--queue", key_prefix, "--file", str(src), "--out", str(out)]  # fmt: skip
    flags = ["--mode", "both", "--outputs", "logps,hidden", "--hidden-dtype", "float32",
             "--max-result-bytes", str(1 << 20)]  # fmt: skip
    with thread_worker(redis_url, key_prefix, executor):
        rc = main([*common, *flags])
        err = capsys.readouterr().err
        assert main([*common, "--outputs", "logps", "--hidden-dtype", "float16"]) == 2
        assert "--hidden-dtype needs --outputs ...,hidden" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            main([*common, "--outputs", "hidden", "--hidden-dtype", "bf16"])
        assert main([*common, "--max-result-bytes", "0"]) == 2
        assert "--max-result-bytes must be a positive number" in capsys.readouterr().err
    assert rc == 1, err  # two lines failed
    got = {d["id"]: d for d in map(json.loads, out.read_text().splitlines())}
    own = _own_rows(executor, "float32")[0]
    assert got["ids"]["hidden_dtype"] == "float32"
    np.testing.assert_array_equal(np.asarray(got["ids"]["hidden"], np.float32), own)
    text = got["text"]
    assert text["ok"] and len(text["span_logps"]) == 4 and len(text["teacher_ids"]) > 0
    assert np.asarray(text["hidden"]).shape == (len(text["logps"]), 32)
    assert [len(s["span_logps"]) for s in got["texts"]["seqs"]] == [4, 4]
    assert got["small"]["error"]["code"] == "too_large"
    assert "max_result_bytes of 64" in got["small"]["error"]["message"]
    assert got["bad"]["error"]["code"] == "bad_request"
    assert "max_result_bytes must be an integer" in got["bad"]["error"]["message"]
