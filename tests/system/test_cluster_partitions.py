"""A partitioned queue on a real 3-primary Redis Cluster: two real workers on the tiny model.

Jobs go through the producer client (``redis+cluster://``) over 4 partitions whose slots live on
all three primaries; every job is answered with the same scores as the in-process executor; one
worker is killed with SIGKILL while it holds entries and the other reclaims them; no CROSSSLOT
error anywhere; ``info`` (the CLI, over the cluster) and ``dlq`` aggregate the partitions.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redis.crc import key_slot

from tests.support.cluster import ClusterInfo, redis_cluster
from tests.support.daemon import ROOT, WorkerProc, wait_until
from worker import keys
from worker.protocol import peek_envelope

pytestmark = [pytest.mark.cluster, pytest.mark.redis, pytest.mark.slow]
__all__ = ["redis_cluster"]  # the session fixture, imported so pytest finds it here

PARTITIONS = 4


@pytest.fixture(scope="module")
def ref_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama saved to a directory."""
    from tests.support.models import tiny_causal

    path = tmp_path_factory.mktemp("models") / "ref"
    tiny_causal("llama", seed=0).save_pretrained(path)
    return str(path)


def _queue_over_all_nodes(cluster: ClusterInfo, base: str) -> str:
    """A queue name whose partitions' slots land on every primary."""
    for n in range(200):
        queue = f"{base}-{n}"
        nodes = {
            cluster.node_of_slot(key_slot(s.encode())) for s in keys.job_streams(queue, PARTITIONS)
        }
        if len(nodes) == len(cluster.ports):
            return queue
    raise AssertionError("no queue name spreads over all primaries")


def _pending(cluster_client: Any, streams: list[str], consumer: str) -> list[tuple[str, str]]:
    out = []
    for s in streams:
        rows = cluster_client.xpending_range(
            s, keys.DEFAULT_GROUP, "-", "+", 1000, consumername=consumer
        )
        out.extend((s, r["message_id"].decode()) for r in rows)
    return out


def _seqs(i: int) -> list[dict[str, Any]]:
    from tests.support.models import random_tokens

    toks = random_tokens(12 + i % 9, seed=1000 + i)
    return [{"tokens": toks, "prompt_len": 3 + i % 4}]


@pytest.mark.timeout(300)
def test_partitioned_queue_on_cluster_two_workers_kill9_reclaim(
    redis_cluster: ClusterInfo, ref_model: str, key_prefix: str, tmp_path: Path
) -> None:
    from worker.client import ScoringClient
    from worker.executor import ExecutorConfig, SequenceInput, StatelessExecutor
    from worker.streams.admin import dlq_list, queue_info

    cluster = redis_cluster
    queue = _queue_over_all_nodes(cluster, key_prefix)
    streams = keys.job_streams(queue, PARTITIONS)
    cc = cluster.client()

    def worker(name: str) -> WorkerProc:
        return WorkerProc(
            ["--redis-url", cluster.url, "--queue", queue, "--partitions", str(PARTITIONS),
             "--consumer", name, "--reference-model", ref_model, "--device", "cpu",
             "--metrics-port", "-1", "--claim-idle-ms", "2000", "--block-ms", "200",
             "--max-wait-ms", "5"],
            tmp_path / f"worker-{name}.log",
        )  # fmt: skip

    a, b = worker("a"), worker("b")
    client = ScoringClient(cluster.url, queue=queue, partitions=PARTITIONS, client_id="ct")
    try:
        a.wait_ready(180)
        b.wait_ready(180)
        executor = StatelessExecutor.from_pretrained(
            ExecutorConfig(device="cpu"), reference_model=ref_model
        )

        # Round 1: jobs spread over every partition, both workers serving.
        handles = {f"r1-{i}": client.submit(_seqs(i), job_id=f"r1-{i}") for i in range(24)}
        assert {h.stream for h in handles.values()} == set(streams)

        # Round 2: keep submitting until worker a is caught holding entries; freeze it, then
        # kill -9 it while those entries are still in its pending list.
        held: list[tuple[str, str]] = []
        n = 0
        for _round in range(40):
            for _ in range(8):
                job_id = f"r2-{n}"
                handles[job_id] = client.submit(_seqs(n), job_id=job_id)
                n += 1
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and not _pending(cc, streams, "a"):
                time.sleep(0.002)
            a.signal(signal.SIGSTOP)
            held = _pending(cc, streams, "a")
            if held:
                a.signal(signal.SIGKILL)
                a.wait_exit(10)
                break
            a.signal(signal.SIGCONT)
        assert held, "worker a was never caught holding entries"
        held_jobs = {
            peek_envelope(cc.xrange(s, eid, eid)[0][1][b"payload"])["id"] for s, eid in held
        }

        results = {job_id: client.result(h, timeout=120) for job_id, h in handles.items()}
        assert len(results) == len(handles)  # every job answered
        for job_id, res in results.items():
            i = int(job_id.split("-")[1])
            seqs = _seqs(i)
            want = executor.score(
                [SequenceInput(s["tokens"], s["prompt_len"]) for s in seqs], mode="reference"
            ).scores
            for got, exp in zip(res, want, strict=True):
                np.testing.assert_allclose(got.logps, exp.logps, atol=1e-4)

        # b took over a's entries (XAUTOCLAIM after the idle limit); nothing is left pending.
        b.wait_log(r"reclaimed \d+ idle entries", 30)
        assert held_jobs <= set(results)
        wait_until(
            lambda: not _pending(cc, streams, "a") and not _pending(cc, streams, "b"),
            30,
            what="every entry acked",
        )
        for w in (a, b):
            assert "CROSSSLOT" not in w.log(), w.log()[-3000:]

        # An undecodable entry on partition 2 is dead-lettered into that partition's DLQ.
        cc.xadd(streams[2], {b"payload": b"\xc1 not msgpack"})
        wait_until(lambda: cc.xlen(keys.dead_letter_stream(streams[2])) == 1, 30, what="DLQ")
        dead = dlq_list(cc, queue, PARTITIONS)
        assert [d.job_stream for d in dead] == [streams[2]]

        # info aggregates the partitions over the cluster (the CLI, as an operator runs it).
        # Workers trim what every group acked (streams.trim_acked), so the lengths are read
        # with them stopped, and compared with each stream's XLEN.
        for w in (a, b):
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGCONT)
            w.stop()
        lengths = [int(cc.xlen(s)) for s in streams]
        assert sum(lengths) <= len(handles) + 1  # acked entries may be trimmed already
        out = subprocess.run(
            [sys.executable, "-m", "worker", "info", "--redis-url", cluster.url,
             "--queue", queue, "--partitions", str(PARTITIONS), "--json"],
            capture_output=True, text=True, timeout=60, cwd=ROOT, env=dict(os.environ),
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert "CROSSSLOT" not in out.stderr
        info = json.loads(out.stdout)
        assert [s["stream"] for s in info["streams"]] == streams
        assert [s["length"] for s in info["streams"]] == lengths
        assert info["total"]["length"] == sum(lengths)
        assert info["total"]["pending"] == 0 and info["total"]["dead_letters"] == 1
        assert info == {**info, "partitions": PARTITIONS}
        assert queue_info(cc, queue, PARTITIONS)["total"]["length"] == sum(lengths)
    finally:
        client.close()
        for w in (a, b):
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGCONT)
            w.stop()
