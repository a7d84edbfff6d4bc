"""``serve --replicas 2`` on the machine's Redis, and partition fairness of one worker.

Real processes: the supervisor runs two real ``serve --scorer noop`` children; a child is killed
with SIGKILL and must come back under a new pid and serve again; SIGTERM to the supervisor drains
both children and it exits 0.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import redis

from tests.support.daemon import ROOT, collect, enqueue, wait_until
from worker import keys
from worker.processes.local import LocalWorker

pytestmark = pytest.mark.redis

SEQ = {"tokens": list(range(1, 17)), "prompt_len": 8}


def _children(ppid: int) -> dict[str, int]:
    """consumer name -> pid of ``ppid``'s live child processes (from /proc)."""
    out: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) != ppid or fields[0] == "Z":
            continue
        args = [a.decode() for a in cmdline]
        if "--consumer" in args:
            out[args[args.index("--consumer") + 1]] = int(entry)
    return out


class Supervised(LocalWorker):
    """``python -m worker serve --replicas N ...`` with its (tagged) output in a file."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        super().__init__(args, log_path=log_path, cwd=ROOT, env={"PYTHONUNBUFFERED": "1"})

    def stop(self, grace_s: float = 30.0) -> int:
        """SIGKILL the children, then the supervisor; close the log."""
        if self.proc.poll() is None:
            for pid in _children(self.proc.pid).values():
                os.kill(pid, signal.SIGKILL)
        self.kill()
        return self.proc.returncode


def _consumers(client: redis.Redis, stream: str) -> set[str]:
    return {c["name"].decode() for c in client.xinfo_consumers(stream, keys.DEFAULT_GROUP)}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_replicas_serve_restart_after_kill9_and_drain_on_sigterm(
    redis_url: str, key_prefix: str, cleanup_keys: None, tmp_path: Path
) -> None:
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix, 1)[0]
    reply = keys.reply_stream(stream, "sup")
    sup = Supervised(
        [
            "--replicas", "2", "--scorer", "noop", "--redis-url", redis_url,
            "--queue", key_prefix, "--consumer", "sup", "--metrics-port", "-1",
            "--noop-delay-ms", "100", "--max-batch-tokens", "16", "--block-ms", "200",
            "--claim-idle-ms", "1500", "--drain-timeout-s", "20",
        ],
        tmp_path / "supervisor.log",
    )  # fmt: skip
    try:
        wait_until(
            lambda: len(re.findall(r"worker sup-\d serving", sup.log())) == 2,
            120,
            what="both children serving",
        )
        pids = _children(sup.proc.pid)
        assert set(pids) == {"sup-0", "sup-1"}
        # Each child's log lines are tagged with its consumer name.
        assert "[sup-0] " in sup.log() and "[sup-1] " in sup.log()

        # Trickle jobs: while one child sleeps in its 100 ms batch, the other is woken.
        ids = [f"a{i}" for i in range(24)]
        for job_id in ids:
            enqueue(client, stream, job_id, reply, [SEQ])
            time.sleep(0.03)
        got, _ = collect(client, reply, ids, timeout=60)
        served = {res.info.get("worker") for res in got.values()}
        assert served == {"sup-0", "sup-1"}, served
        assert all(res.ok for res in got.values())
        assert {"sup-0", "sup-1"} <= _consumers(client, stream)

        # kill -9 child 0 mid-stream: the supervisor restarts it (new pid) and it serves again.
        more = [f"b{i}" for i in range(12)]
        for job_id in more[:6]:
            enqueue(client, stream, job_id, reply, [SEQ])
        os.kill(pids["sup-0"], signal.SIGKILL)
        killed_at = time.time()
        new_pid = wait_until(
            lambda: (p := _children(sup.proc.pid).get("sup-0")) and p != pids["sup-0"] and p,
            30,
            what="child 0 restarted",
        )
        assert new_pid != pids["sup-0"]
        assert _children(sup.proc.pid)["sup-1"] == pids["sup-1"], "the healthy child restarted"
        wait_until(
            lambda: len(re.findall(r"worker sup-0 serving", sup.log())) == 2,
            120,
            what="restarted child serving",
        )
        for job_id in more[6:]:
            enqueue(client, stream, job_id, reply, [SEQ])
            time.sleep(0.05)
        got, _ = collect(client, reply, ids + more, timeout=60)  # every job answered
        assert all(res.ok for res in got.values())
        after = [
            int(eid.decode().split("-")[0]) / 1000.0
            for eid, f in client.xrange(reply)
            if b"sup-0" in f[b"payload"]
        ]
        assert max(after) > killed_at + 0.1, "the restarted child 0 never served"
        assert "restart 1 in" in sup.log()

        # SIGTERM: both children drain and the supervisor exits 0.
        sup.proc.send_signal(signal.SIGTERM)
        assert sup.proc.wait(60) == 0, sup.log()
        log = sup.log()
        assert re.search(r"worker sup-0 stopped after \d+ jobs", log)
        assert re.search(r"worker sup-1 stopped after \d+ jobs", log)
        assert _children(sup.proc.pid) == {}
        assert int(client.xpending(stream, keys.DEFAULT_GROUP)["pending"]) == 0
    finally:
        sup.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_flooded_partition_does_not_starve_the_others(
    redis_url: str, key_prefix: str, cleanup_keys: None, tmp_path: Path
) -> None:
    """4 partitions, partition 0 holds 160 jobs queued before 6 jobs on each other partition:
    one worker answers every job of partitions 1-3 while partition 0 still has most of its work."""
    client = redis.Redis.from_url(redis_url)
    streams = keys.job_streams(key_prefix, 4)
    reply = keys.reply_stream(streams[0], "fair")  # one reply stream: one global answer order
    for s in streams:
        client.xgroup_create(s, keys.DEFAULT_GROUP, id="0", mkstream=True)
    flood = [f"p0-{i}" for i in range(160)]
    others = [f"p{p}-{i}" for p in (1, 2, 3) for i in range(6)]
    pipe = client.pipeline(transaction=False)
    for job_id in flood:
        pipe.xadd(streams[0], {"payload": _payload(job_id, reply)})
    for job_id in others:
        pipe.xadd(streams[int(job_id[1])], {"payload": _payload(job_id, reply)})
    pipe.execute()
    log_path = tmp_path / "worker.log"
    worker = LocalWorker(
        [
            "--scorer", "noop",
            "--redis-url", redis_url, "--queue", key_prefix, "--partitions", "4",
            "--consumer", "fair", "--metrics-port", "-1", "--burst",
            "--max-batch-tokens", "64", "--noop-delay-ms", "5",
        ],
        log_path=log_path, cwd=ROOT,
    )  # fmt: skip
    try:
        assert worker.proc.wait(90) == 0, log_path.read_text()
    finally:
        worker.kill()
    order = [
        _result_id(f[b"payload"]) for _, f in client.xrange(reply)
    ]  # the order results were written
    assert set(order) == set(flood) | set(others)
    last_other = max(order.index(j) for j in others)
    flood_before = sum(1 for j in order[:last_other] if j.startswith("p0-"))
    # Partitions 1-3 are all answered while at least half of the flood is still waiting.
    assert flood_before <= len(flood) // 2, (flood_before, order[: last_other + 1])


def _payload(job_id: str, reply: str) -> bytes:
    from worker.protocol import encode_job

    return encode_job(job_id, "reference", reply, [SEQ])


def _result_id(payload: bytes) -> str:
    from worker.protocol import decode_result

    return decode_result(payload).id
