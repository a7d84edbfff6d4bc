"""The synchronous client against the real Redis, with a worker test double (client logic)."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
import redis

from tests.support.client import OutstandingSampler, Responder, expected_logps
from worker import errors, keys, protocol
from worker.client import (
    BadRequestError,
    DeadLetterError,
    ExpiredError,
    InternalJobError,
    JobFailed,
    ScoringClient,
    ScoringTimeout,
    TooLongError,
    UnsupportedModeError,
)
from worker.client import window as window_mod

pytestmark = [pytest.mark.redis, pytest.mark.timeout(30), pytest.mark.usefixtures("cleanup_keys")]


def test_score_a_batch_in_three_lines(redis_url: str, key_prefix: str) -> None:
    streams = keys.job_streams(key_prefix)
    toks = [5, 6, 7, 8, 9]
    with Responder(redis_url, streams), ScoringClient(redis_url, queue=key_prefix) as client:
        scores = client.score(
            [
                {"tokens": toks, "prompt_len": 2},
                (np.array(toks, dtype=np.int64), 3),
                {"tokens": toks, "mask": [0, 1, 0, 1, 1]},
            ],
            timeout=10,
        )
    assert len(scores) == 3
    assert scores[0].logps.dtype == np.float32
    np.testing.assert_allclose(scores[0].logps, expected_logps(toks, 2), rtol=1e-6)
    np.testing.assert_allclose(scores[1].logps, expected_logps(toks, 3), rtol=1e-6)
    np.testing.assert_allclose(scores[2].logps, [-0.06, -0.08, -0.09], rtol=1e-6)
    assert scores[0].num_tokens == 3
    assert scores[0].sum_logp == pytest.approx(-0.24, rel=1e-5)
    assert scores[0].mean_logp == pytest.approx(-0.08, rel=1e-5)


def test_result_carries_info_meta_and_reward(redis_url: str, key_prefix: str) -> None:
    with (
        Responder(redis_url, keys.job_streams(key_prefix)),
        ScoringClient(redis_url, queue=key_prefix) as client,
    ):
        handle = client.submit([([1, 2, 3], 1)], mode="both", meta={"step": 7})
        result = client.result(handle, timeout=10)
    assert result.job_id == handle.job_id
    assert result.meta == {"step": 7}
    assert result.info["backend"] == "double"
    assert result[0].reward == 3.0


def test_results_for_other_jobs_are_buffered(redis_url: str, key_prefix: str) -> None:
    with (
        Responder(redis_url, keys.job_streams(key_prefix)),
        ScoringClient(redis_url, queue=key_prefix) as client,
    ):
        handles = [client.submit([([1, 2, 3 + i], 1)]) for i in range(5)]
        time.sleep(0.3)  # all five results arrive before anyone asks
        for h in reversed(handles):
            assert client.result(h, timeout=5).job_id == h.job_id
        assert client.outstanding == 0


def test_partitions_spread_jobs_and_share_one_reply_stream(redis_url: str, key_prefix: str) -> None:
    streams = keys.job_streams(key_prefix, 3)
    with (
        Responder(redis_url, streams) as double,
        ScoringClient(redis_url, queue=key_prefix, partitions=3) as client,
    ):
        handles = [client.submit([([1, 2, 3], 1)]) for _ in range(24)]
        assert {h.stream for h in handles} == set(streams)
        assert client.reply_stream == keys.reply_stream(streams[0], client.client_id)
        for h in handles:
            assert client.stream_for(h.job_id) == h.stream
            client.result(h, timeout=5)
    assert double.answered == 24


@pytest.mark.parametrize("ordered", [True, False])
def test_score_many_never_exceeds_max_in_flight(
    redis_url: str, key_prefix: str, ordered: bool
) -> None:
    streams = keys.job_streams(key_prefix, 2)
    jobs = [[([1, 2, 3, i % 50 + 4], 2)] for i in range(40)]
    with (
        Responder(redis_url, streams, delay_s=0.01, count=1),
        ScoringClient(redis_url, queue=key_prefix, partitions=2) as client,
        OutstandingSampler(redis_url, streams) as sampler,
    ):
        results = list(client.score_many(jobs, max_in_flight=4, ordered=ordered, timeout=10))
    assert len(results) == 40
    if ordered:
        got = [r.seqs[0].logps[-1] for r in results]
        np.testing.assert_allclose(got, [-(i % 50 + 4) / 100 for i in range(40)], rtol=1e-6)
    assert sampler.samples > 20
    assert 2 <= sampler.peak <= 4, sampler.peak


def test_timeout_names_the_job_and_the_wait(redis_url: str, key_prefix: str) -> None:
    stream = keys.job_streams(key_prefix)[0]
    redis.Redis.from_url(redis_url).xgroup_create(stream, "scoring", id="0", mkstream=True)
    with ScoringClient(redis_url, queue=key_prefix) as client:  # served once, no worker now
        handle = client.submit([([1, 2, 3], 1)])
        start = time.monotonic()
        with pytest.raises(ScoringTimeout) as info:
            client.result(handle, timeout=0.3)
        assert 0.3 <= time.monotonic() - start < 2
    assert info.value.job_id == handle.job_id
    assert handle.job_id in str(info.value)
    assert "0.3 s" in str(info.value)
    assert f"no worker served queue {key_prefix!r}" in str(info.value)
    assert isinstance(info.value, TimeoutError)


def test_duplicate_results_are_dropped(redis_url: str, key_prefix: str) -> None:
    with (
        Responder(redis_url, keys.job_streams(key_prefix)),
        ScoringClient(redis_url, queue=key_prefix) as client,
    ):
        handle = client.submit([([1, 2, 3], 1)], meta={"dup": 2})
        client.result(handle, timeout=5)
        deadline = time.monotonic() + 5
        while client.duplicates < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.duplicates == 2
        with pytest.raises(ScoringTimeout):
            client.result(handle, timeout=0.2)  # delivered once, never again
        # duplicates that arrive before the first one is taken are dropped too
        h2 = client.submit([([1, 2, 3], 1)], meta={"dup": 3})
        time.sleep(0.3)
        client.result(h2, timeout=5)
        assert client.duplicates == 5


@pytest.mark.parametrize(
    ("code", "cls", "base"),
    [
        ("bad_request", BadRequestError, errors.BadRequest),
        ("too_long", TooLongError, errors.TooLong),
        ("unsupported_mode", UnsupportedModeError, errors.UnsupportedMode),
        ("expired", ExpiredError, errors.Expired),
        ("dead_letter", DeadLetterError, errors.DeadLetter),
        ("internal", InternalJobError, errors.InternalError),
    ],
)
def test_error_results_raise_typed_exceptions(
    redis_url: str, key_prefix: str, code: str, cls: type, base: type
) -> None:
    with (
        Responder(redis_url, keys.job_streams(key_prefix)),
        ScoringClient(redis_url, queue=key_prefix) as client,
    ):
        handle = client.submit([([1, 2, 3], 1)], meta={"fail": code})
        with pytest.raises(cls) as info:
            client.result(handle, timeout=5)
    err = info.value
    assert isinstance(err, JobFailed) and isinstance(err, base)
    assert isinstance(err, errors.ScoringError)
    assert err.code == code
    assert err.job_id == handle.job_id
    assert err.reason == f"told to fail with {code}"
    assert code in str(err) and handle.job_id in str(err)


def test_score_many_can_yield_errors_instead_of_raising(redis_url: str, key_prefix: str) -> None:
    jobs = [
        {"seqs": [([1, 2, 3], 1)], "meta": {"fail": "expired"} if i == 2 else {"i": i}}
        for i in range(5)
    ]
    with (
        Responder(redis_url, keys.job_streams(key_prefix)),
        ScoringClient(redis_url, queue=key_prefix) as client,
    ):
        out = list(client.score_many(jobs, max_in_flight=2, raise_errors=False, timeout=5))
        assert [type(o).__name__ for o in out] == ["ScoreResult"] * 2 + ["ExpiredError"] + [
            "ScoreResult"
        ] * 2
        with pytest.raises(ExpiredError):
            list(client.score_many(jobs, max_in_flight=2, timeout=5))


def test_reply_stream_is_deleted_on_close(redis_url: str, key_prefix: str) -> None:
    r = redis.Redis.from_url(redis_url)
    with Responder(redis_url, keys.job_streams(key_prefix)):
        client = ScoringClient(redis_url, queue=key_prefix, reply_ttl_s=60)
        client.score([([1, 2, 3], 1)], timeout=5)
        time.sleep(0.1)
        assert r.exists(client.reply_stream)
        assert 0 < r.ttl(client.reply_stream) <= 60
        assert r.xlen(client.reply_stream) == 0  # read results are deleted from the stream
        start = time.monotonic()
        client.close()
        assert time.monotonic() - start < 1.0  # close wakes the blocked reader
    assert not r.exists(client.reply_stream)


def test_reply_stream_expires_when_closed_with_jobs_outstanding(
    redis_url: str, key_prefix: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    client = ScoringClient(redis_url, queue=key_prefix, reply_ttl_s=30, wait_for_unknown_queue=True)
    client.submit([([1, 2, 3], 1)])  # nobody answers
    client.close()
    assert 0 < r.ttl(client.reply_stream) <= 30


def test_reader_survives_a_connection_reset(redis_url: str, key_prefix: str) -> None:
    r = redis.Redis.from_url(redis_url)
    with (
        Responder(redis_url, keys.job_streams(key_prefix)),
        ScoringClient(redis_url, queue=key_prefix, block_ms=5000) as client,
    ):
        client.score([([1, 2, 3], 1)], timeout=5)
        time.sleep(0.1)  # the reader is now blocked in XREAD on our reply stream
        killed = 0
        for c in r.client_list():
            if c.get("cmd") == "xread" and c.get("name") == f"scoring-client-{client.client_id}":
                killed += r.client_kill_filter(_id=c["id"])
        assert killed >= 1
        assert len(client.score([([1, 2, 3], 1)], timeout=5)) == 1


def test_bad_input_fails_fast_without_enqueueing(redis_url: str, key_prefix: str) -> None:
    r = redis.Redis.from_url(redis_url)
    with ScoringClient(redis_url, queue=key_prefix) as client:
        with pytest.raises(errors.BadRequest):
            client.submit([([1, 2, 3], 3)])  # prompt_len must leave a token to score
        with pytest.raises(errors.BadRequest):
            client.submit([{"tokens": [1.5, 2.0]}])
        with pytest.raises(errors.BadRequest):
            client.submit([])
    assert not r.exists(keys.job_streams(key_prefix)[0])


def test_torch_tensors_are_accepted(redis_url: str, key_prefix: str) -> None:
    torch = pytest.importorskip("torch")
    with (
        Responder(redis_url, keys.job_streams(key_prefix)),
        ScoringClient(redis_url, queue=key_prefix) as client,
    ):
        scores = client.score([(torch.tensor([4, 5, 6]), torch.tensor(1))], timeout=5)
    np.testing.assert_allclose(scores[0].logps, [-0.05, -0.06], rtol=1e-6)


_NO_TORCH = r"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import worker.client, worker.client.aio, worker.streams.admin
from worker.client import ScoringClient
url, queue = sys.argv[1], sys.argv[2]
with ScoringClient(url, queue=queue, wait_for_unknown_queue=True) as c:
    h = c.submit([([1, 2, 3], 1)])
    assert h.job_id
assert not any(m.split(".")[0] in ("torch", "transformers") for m in sys.modules)
print("ok")
"""


def test_client_imports_and_submits_with_torch_blocked(redis_url: str, key_prefix: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, redis_url, key_prefix],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# ----------------------------------------------------------------------------- score_many waits


@pytest.mark.parametrize("ordered", [True, False])
def test_score_many_without_timeout_waits_across_slices(
    redis_url: str, key_prefix: str, ordered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """timeout=None waits as long as it takes, in bounded slices (it used to give up after the
    one-hour cap); here the slice is 20 ms and the worker takes 0.4 s per job."""
    monkeypatch.setattr(window_mod, "_WAIT_SLICE_S", 0.02)
    waits: list[float] = []
    with (
        Responder(redis_url, keys.job_streams(key_prefix), delay_s=0.4, count=1),
        ScoringClient(redis_url, queue=key_prefix) as client,
    ):
        real_wait_any = client._core.wait_any

        def counting_wait_any(job_ids: Any, timeout: float) -> Any:
            waits.append(timeout)
            return real_wait_any(job_ids, timeout)

        monkeypatch.setattr(client._core, "wait_any", counting_wait_any)
        jobs = [{"seqs": [([1, 2, 3], 1)], "meta": {"i": i}} for i in range(2)]
        out = list(client.score_many(jobs, max_in_flight=2, ordered=ordered, timeout=None))
    assert sorted(r.meta["i"] for r in out) == [0, 1]
    assert len(waits) > 5 and max(waits) <= 0.02


@pytest.mark.parametrize("ordered", [True, False])
def test_score_many_timeout_reports_the_real_wait(
    redis_url: str, key_prefix: str, ordered: bool
) -> None:
    jobs = [{"seqs": [([1, 2, 3], 1)], "meta": {"drop": True}}, [([1, 2, 3], 1)]]
    with (
        Responder(redis_url, keys.job_streams(key_prefix)),
        ScoringClient(redis_url, queue=key_prefix) as client,
    ):
        start = time.monotonic()
        with pytest.raises(ScoringTimeout) as info:
            list(client.score_many(jobs, max_in_flight=2, ordered=ordered, timeout=0.3))
        elapsed = time.monotonic() - start
        # the dropped job is abandoned with the iterator: nothing stays tracked
        assert client.outstanding == 0
    exc = info.value
    assert 0.3 <= exc.waited_s <= elapsed + 0.01
    assert f"after waiting {exc.waited_s:.1f} s" in str(exc)
    assert "0.0 s" not in str(exc)


# ----------------------------------------------------------------------------- inputs


def test_lists_of_numpy_and_torch_scalars_are_accepted(redis_url: str, key_prefix: str) -> None:
    seqs: list[Any] = [
        (list(np.array([4, 5, 6])), np.int64(1)),
        {"tokens": [np.int32(4), np.uint16(5), 6], "prompt_len": np.int8(2)},
        (tuple(np.arange(4, 7)), 1),
    ]
    try:
        import torch
    except ImportError:  # torch is optional for producers
        torch = None
    if torch is not None:
        seqs.append((list(torch.tensor([4, 5, 6])), torch.tensor(1)))
    with (
        Responder(redis_url, keys.job_streams(key_prefix)) as double,
        ScoringClient(redis_url, queue=key_prefix) as client,
    ):
        scores = client.score(seqs, timeout=10)
    assert len(scores) == len(seqs)
    for s in scores:
        assert len(s.logps) in (1, 2)
    np.testing.assert_allclose(scores[0].logps, [-0.05, -0.06], rtol=1e-6)
    np.testing.assert_allclose(scores[1].logps, [-0.06], rtol=1e-6)
    assert [list(s.tokens) for s in double.seen_jobs[0].seqs] == [[4, 5, 6]] * len(seqs)


@pytest.mark.parametrize(
    ("tokens", "what"),
    [
        ([1, True, 3], "boolean"),
        ([np.True_, 2, 3], "boolean"),
        ([1.0, 2.0, 3.0], "float"),
        ([np.float64(1), 2, 3], "float64"),
        (["1", "2"], "str"),
    ],
)
def test_boolean_and_float_token_ids_are_rejected(
    redis_url: str, key_prefix: str, tokens: list[Any], what: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    with (
        ScoringClient(redis_url, queue=key_prefix) as client,
        pytest.raises(BadRequestError, match=f"token ids must be integers.*{what}"),
    ):
        client.submit([(tokens, 1)])
    assert not r.exists(keys.job_streams(key_prefix)[0])


def test_boolean_prompt_len_is_rejected(redis_url: str, key_prefix: str) -> None:
    with ScoringClient(redis_url, queue=key_prefix) as client:
        for seq in ([1, 2, 3], True), {"tokens": [1, 2, 3], "prompt_len": np.True_}:
            with pytest.raises(errors.BadRequest, match="prompt_len must be an integer"):
                client.submit([seq])


# ----------------------------------------------------------------------------- memory


def _wait_for(pred: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_score_timeout_forgets_the_job_and_drops_its_late_result(
    redis_url: str, key_prefix: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    with Responder(redis_url, keys.job_streams(key_prefix), delay_s=0.5):
        client = ScoringClient(redis_url, queue=key_prefix)
        with pytest.raises(ScoringTimeout):
            client.score([([1, 2, 3], 1)], timeout=0.1)
        assert client.outstanding == 0
        _wait_for(lambda: client.late_results == 1)
        assert client._buffer.ready == {} and not client._buffer.abandoned
        assert client.duplicates == 0
        client.close()  # nothing can arrive any more: the stream is deleted
    assert not r.exists(client.reply_stream)


def test_forget_drops_buffered_and_pending_results(redis_url: str, key_prefix: str) -> None:
    r = redis.Redis.from_url(redis_url)
    with Responder(redis_url, keys.job_streams(key_prefix)):
        client = ScoringClient(redis_url, queue=key_prefix, reply_ttl_s=40)
        answered = client.submit([([1, 2, 3], 1)])
        _wait_for(lambda: answered.job_id in client._buffer.ready)
        assert client.forget(answered)  # its buffered result goes
        assert client._buffer.ready == {} and client.outstanding == 0
        dropped = client.submit([([1, 2, 3], 1)], meta={"drop": True})
        with pytest.raises(ScoringTimeout):
            client.result(dropped, timeout=0.1)
        assert client.outstanding == 1  # a timeout alone keeps the job: the caller may wait again
        assert client.forget(dropped.job_id)
        assert not client.forget(dropped.job_id)  # already forgotten
        assert client.outstanding == 0
        with pytest.raises(ScoringTimeout):
            client.result(answered, timeout=0.1)  # forgotten results are gone for good
        client.close()
    # the forgotten job was never answered: the stream is left to expire, not deleted
    assert 0 < r.ttl(client.reply_stream) <= 40


def test_unclaimed_results_are_bounded(redis_url: str, key_prefix: str) -> None:
    with ScoringClient(redis_url, queue=key_prefix) as client:
        client._buffer.max_unclaimed = 3
        r = redis.Redis.from_url(redis_url)
        for i in range(5):  # results nobody submitted through this client
            payload = protocol.encode_result(protocol.Result(id=f"x{i}", ok=True))
            r.xadd(client.reply_stream, {protocol.PAYLOAD_FIELD: payload})
        assert client.raw_result("x4", timeout=5).id == "x4"
        assert client.evicted_results == 2
        assert sorted(client._buffer.ready) == ["x2", "x3"]
        assert client.raw_result("x3", timeout=1).id == "x3"
        with pytest.raises(ScoringTimeout):
            client.raw_result("x0", timeout=0.05)
