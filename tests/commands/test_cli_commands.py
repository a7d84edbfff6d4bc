"""The producer/operator CLI against the real Redis and a real worker (``serve --scorer noop``):
enqueue a JSONL file end to end and resume it, ``info --json``, ``dlq`` list/replay/purge and
``check``."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import redis

from tests.support.daemon import WorkerProc, add_dead_letter, wait_until
from worker import keys, protocol
from worker.cli import main
from worker.client import DeadLetterError, ScoringClient
from worker.processes.local import free_port

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("cleanup_keys")]


def _noop_logps(tokens: list[int], scored: list[int]) -> list[float]:
    """What the noop scorer answers (see worker/scorer/noop.py)."""
    return [-math.log(32000) - (tokens[i] % 7) / 100 for i in scored]


def _worker(
    redis_url: str, queue: str, tmp_path: Path, *extra: str, port: int | None = None
) -> WorkerProc:
    args = ["--redis-url", redis_url, "--queue", queue, "--scorer", "noop", "--block-ms", "100"]
    args += ["--metrics-port", str(port if port is not None else -1), *extra]
    return WorkerProc(args, tmp_path / f"worker-{queue}.log").wait_ready(60)


def _rollouts(n: int) -> list[dict]:
    out: list[dict] = []
    for i in range(n):
        toks = [(i * 7 + k) % 50 + 1 for k in range(4 + i % 5)]
        if i % 3 == 0:
            out.append({"id": f"r{i}", "tokens": toks, "mask": [0, 0] + [1] * (len(toks) - 2)})
        else:
            out.append({"id": f"r{i}", "tokens": toks, "prompt_len": 1, "meta": {"i": i}})
    return out


def _scored(line: dict) -> list[int]:
    if "mask" in line:
        return [k for k, m in enumerate(line["mask"]) if m]
    return list(range(line["prompt_len"], len(line["tokens"])))


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_enqueue_jsonl_end_to_end_and_resume(
    redis_url: str, key_prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rollouts = _rollouts(12)
    src = tmp_path / "rollouts.jsonl"
    lines = [json.dumps(r) for r in rollouts]
    lines.insert(3, json.dumps({"id": "bad", "tokens": [1, 2], "prompt_len": 2}))  # scores nothing
    lines.append(json.dumps({"seqs": [{"tokens": [1, 2, 3], "prompt_len": 1}] * 2}))  # line-14
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "scores.jsonl"
    common = ["--redis-url", redis_url, "--queue", key_prefix, "--no-progress"]
    worker = _worker(redis_url, key_prefix, tmp_path)
    try:
        rc = main(
            ["enqueue", *common, "--file", str(src), "--out", str(out), "--max-in-flight", "4"]
        )
        err = capsys.readouterr().err
        assert rc == 1  # the bad line is reported, not sent
        assert "skipped line 4: id bad" in err and "13 scored, 0 failed" in err
        got = {d["id"]: d for d in map(json.loads, out.read_text().splitlines())}
        assert set(got) == {f"r{i}" for i in range(12)} | {"line-14"}
        for r in rollouts:
            d = got[r["id"]]
            assert d["ok"] is True
            assert d["logps"] == pytest.approx(_noop_logps(r["tokens"], _scored(r)), rel=1e-5)
            assert d.get("meta") == r.get("meta")
            assert "backend" in d["info"] or d["info"]
        assert len(got["line-14"]["seqs"]) == 2

        # simulate a crash: keep 5 results and a torn half line, then run the same command again
        kept = out.read_text().splitlines()[:5]
        out.write_text("\n".join(kept) + "\n" + '{"id": "r1', encoding="utf-8")
        stream = keys.job_streams(key_prefix)[0]
        before = redis.Redis.from_url(redis_url).xlen(stream)
        rc = main(["enqueue", *common, "--file", str(src), "--out", str(out)])
        err = capsys.readouterr().err
        assert "8 scored, 0 failed; earlier runs: 5 scored, 0 failed" in err
        resubmitted = redis.Redis.from_url(redis_url).xlen(stream) - before
        assert resubmitted == 8
        final = [json.loads(x) for x in out.read_text().splitlines()]
        assert sorted(d["id"] for d in final) == sorted(got)
        assert final[:5] == [json.loads(x) for x in kept]
    finally:
        worker.stop()


@pytest.mark.timeout(30)
def test_info_json_fields(
    redis_url: str, key_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    r = redis.Redis.from_url(redis_url)
    s0, s1 = keys.job_streams(key_prefix, 2)
    for s in (s0, s1):
        r.xgroup_create(s, "scoring", id="0", mkstream=True)
    payload = protocol.encode_job(
        "j", "reference", "x:{t}:replies:c", [{"tokens": [1, 2], "prompt_len": 1}]
    )
    for _ in range(3):
        r.xadd(s0, {"payload": payload})
    r.xadd(s1, {"payload": payload})
    r.xreadgroup("scoring", "gpu-0", {s0: ">"}, count=2)
    r.xadd(keys.dead_letter_stream(s1), {"payload": payload, "reason": "max_deliveries: test"})
    time.sleep(0.05)
    rc = main(
        ["info", "--redis-url", redis_url, "--queue", key_prefix, "--partitions", "2", "--json"]
    )
    assert rc == 0
    info = json.loads(capsys.readouterr().out)
    assert info["queue"] == key_prefix and info["group"] == "scoring" and info["partitions"] == 2
    assert info["total"] == {
        "length": 4,
        "lag": 2,
        "pending": 2,
        "oldest_pending_age_s": info["total"]["oldest_pending_age_s"],
        "consumers": 1,
        "dead_letters": 1,
    }
    assert 0.04 <= info["total"]["oldest_pending_age_s"] < 10
    p0, p1 = info["streams"]
    assert (p0["stream"], p0["length"], p0["lag"], p0["pending"]) == (s0, 3, 1, 2)
    assert (p1["stream"], p1["length"], p1["lag"], p1["pending"]) == (s1, 1, 1, 0)
    assert p1["oldest_pending_age_s"] is None and p1["dead_letters"] == 1
    assert [c["name"] for c in p0["consumers"]] == ["gpu-0"]
    assert p0["consumers"][0]["pending"] == 2 and p0["consumers"][0]["idle_s"] >= 0
    # the table names both streams and the consumer
    assert main(["info", "--redis-url", redis_url, "--queue", key_prefix, "--partitions", "2"]) == 0
    table = capsys.readouterr().out
    assert s0 in table and s1 in table and "gpu-0" in table and "total" in table


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_dlq_replay_brings_a_dead_lettered_job_back_to_a_result(
    redis_url: str, key_prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    dead = keys.dead_letter_stream(stream)
    r.xgroup_create(stream, "scoring", id="0", mkstream=True)
    client = ScoringClient(redis_url, queue=key_prefix)
    handle = client.submit([([3, 4, 5, 6], 2)])
    r.xreadgroup("scoring", "ghost", {stream: ">"})  # a consumer that dies holding the job
    worker = _worker(
        redis_url, key_prefix, tmp_path, "--claim-idle-ms", "200", "--max-deliveries", "1"
    )
    common = ["--redis-url", redis_url, "--queue", key_prefix]
    try:
        with pytest.raises(DeadLetterError) as info:
            client.result(handle, timeout=20)
        assert info.value.code == "dead_letter" and "delivered 2 times" in info.value.reason
        client.close()
        assert main(["dlq", "list", *common, "--json"]) == 0
        entry, summary = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert summary["summary"]["total"] == 1
        assert entry["job_id"] == handle.job_id and entry["deliveries"] == 2
        assert entry["reason"].startswith("max_deliveries")
        assert main(["dlq", "list", *common]) == 0
        assert handle.job_id in capsys.readouterr().out
        assert main(["dlq", "replay", *common]) == 2  # needs ids or --all
        assert main(["dlq", "replay", *common, handle.job_id]) == 0
        assert f"replayed {handle.job_id}" in capsys.readouterr().out
        assert r.xlen(dead) == 0

        def ok_result() -> protocol.Result | None:
            for _, fields in r.xrange(client.reply_stream):
                res = protocol.decode_result(fields[b"payload"])
                if res.ok:
                    return res
            return None

        res = wait_until(ok_result, 20, what="the replayed job's result")
        assert res.id == handle.job_id
        assert list(res.seqs[0].logps) == pytest.approx(_noop_logps([3, 4, 5, 6], [2, 3]))
    finally:
        worker.stop()
    # purge needs --yes, then removes what is there
    r.xadd(dead, {"payload": b"x", "reason": "test"})
    assert main(["dlq", "purge", *common, "--all"]) == 2
    assert main(["dlq", "purge", *common, "--all", "--yes"]) == 0
    assert r.xlen(dead) == 0


@pytest.mark.timeout(30)
def test_dlq_per_partition_column_filter_and_counts(
    redis_url: str, key_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dlq list`` on a 3-partition queue: a partition and stream column, ``--partition N``,
    per-partition counts and the total (text and --json); replay/purge per partition."""
    r = redis.Redis.from_url(redis_url)
    s0, s1, s2 = keys.job_streams(key_prefix, 3)
    for job_id in ("a0", "a1"):
        add_dead_letter(r, s0, job_id)
    for job_id in ("c0", "c1", "c2"):
        add_dead_letter(r, s2, job_id, reason="reply_failed: WRONGTYPE")
    common = ["--redis-url", redis_url, "--queue", key_prefix, "--partitions", "3"]

    def dlq_json(*extra: str) -> tuple[list[dict], dict]:
        assert main(["dlq", "list", *common, "--json", *extra]) == 0
        *rows, last = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        return rows, last["summary"]

    rows, summary = dlq_json()
    assert [(e["partition"], e["job_stream"], e["job_id"]) for e in rows] == [
        (0, s0, "a0"),
        (0, s0, "a1"),
        (2, s2, "c0"),
        (2, s2, "c1"),
        (2, s2, "c2"),
    ]
    assert summary["total"] == 5 and summary["listed"] == 5 and summary["partitions"] == 3
    assert [(p["partition"], p["stream"], p["dead_letters"]) for p in summary["by_partition"]] == [
        (0, s0, 2),
        (1, s1, 0),
        (2, s2, 3),
    ]
    assert summary["by_partition"][2]["dead_letter_stream"] == keys.dead_letter_stream(s2)

    rows, summary = dlq_json("--partition", "2", "--limit", "2")
    assert [(e["partition"], e["job_id"]) for e in rows] == [(2, "c0"), (2, "c1")]
    assert summary["total"] == 3 and summary["listed"] == 2 and summary["limit"] == 2
    assert [(p["partition"], p["dead_letters"], p["listed"]) for p in summary["by_partition"]] == [
        (2, 3, 2)
    ]

    assert main(["dlq", "list", *common]) == 0
    table = capsys.readouterr().out.splitlines()
    head = table[0].split()
    assert head[:3] == ["PART", "STREAM", "DLQ"] and "REASON" in head
    c1 = next(line.split() for line in table if " c1 " in line)
    assert c1[:2] == ["2", s2] and c1[-2:] == ["reply_failed:", "WRONGTYPE"]
    counts = {line.split()[0]: line.split()[1:] for line in table[table.index("") + 2 :]}
    assert counts == {"0": [s0, "2"], "1": [s1, "0"], "2": [s2, "3"], "total": ["5"]}

    assert main(["dlq", "list", *common, "--partition", "1"]) == 0
    assert f"no dead letters in queue {key_prefix!r} partition 1" in capsys.readouterr().out
    assert main(["dlq", "list", *common, "--partition", "3"]) == 2
    assert "--partition must be in 0..2" in capsys.readouterr().err

    # replay and purge act on the chosen partition only
    assert main(["dlq", "replay", *common, "--partition", "0", "--all"]) == 0
    assert f"replayed a0 -> {s0}" in capsys.readouterr().out
    assert (r.xlen(s0), r.xlen(keys.dead_letter_stream(s0)), r.xlen(s2)) == (2, 0, 0)
    assert main(["dlq", "purge", *common, "--partition", "2", "c1", "--yes"]) == 0
    assert main(["dlq", "purge", *common, "--partition", "0", "--all", "--yes"]) == 0
    assert capsys.readouterr().out.splitlines() == ["1 purged", "0 purged"]
    assert [e["job_id"] for e in dlq_json()[0]] == ["c0", "c2"]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_check_exit_codes(
    redis_url: str, key_prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", "--redis-url", redis_url]) == 0
    assert (
        main(["check", "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--timeout-s", "1"])
        == 1
    )
    port = free_port()
    worker = _worker(redis_url, key_prefix, tmp_path, port=port)
    try:
        base = f"http://127.0.0.1:{port}"
        assert main(["check", "--url", f"{base}/readyz", "--url", f"{base}/healthz"]) == 0
        assert main(["check", "--url", f"{base}/readyz", "--redis", "--redis-url", redis_url]) == 0
    finally:
        worker.stop()
    assert main(["check", "--url", f"http://127.0.0.1:{port}/readyz", "--timeout-s", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "unreachable" in out
