"""Failover: a Redis Cluster of 3 primaries with a replica each (``cluster-node-timeout``
1000 ms), two no-op workers and a producer under load; kill -9 the primary that holds the reply
stream and partition 0, let its replica be promoted, keep going. Counts lost, duplicated and
altered jobs with resubmission off/on, durable submit off/on, and the workers' only seed node
among the victims or not; every worker must be alive and serving at the end.

The quick variant (inside ``make test``) runs one configuration; ``make test-faults`` runs all
eight and prints them in the fault summary (``failover[...]`` rows). No-op scorer: the scores
are a deterministic function of the tokens, so "altered" is checked exactly.
"""

from __future__ import annotations

import math
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from tests.faults.harness import REPORTS, PhaseReport
from tests.support.daemon import WorkerProc, metric
from tests.support.failover import FailoverCluster
from worker import keys
from worker.client import ScoringClient

pytestmark = [pytest.mark.faults, pytest.mark.cluster, pytest.mark.slow]

PARTITIONS = 3
CONFIGS = [
    (resubmit, durable, seed_victim)
    for resubmit in (False, True)
    for durable in (False, True)
    for seed_victim in (True, False)
]
QUICK = (True, False, True)


def _seqs(i: int) -> list[dict[str, object]]:
    return [{"tokens": [(i + k) % 997 + 1 for k in range(12)], "prompt_len": 4}]


def _expected(i: int) -> np.ndarray:
    toks = np.asarray(_seqs(i)[0]["tokens"], dtype=np.int64)[4:]  # type: ignore[index]
    return (-math.log(32000) - (toks % 7) / 100.0).astype(np.float32)


def _node_of(cluster: FailoverCluster, key: str) -> int:
    c = redis.RedisCluster(host="127.0.0.1", port=cluster.alive()[0])
    try:
        return int(c.get_node_from_key(key).port)
    finally:
        c.close()


def run_failover(
    workdir: Path,
    *,
    resubmit: bool,
    durable: bool,
    seed_victim: bool,
    jobs: int,
    rate: float,
    worker_durable: bool = False,
) -> PhaseReport:
    """One configuration; the report of what the producer saw. ``worker_durable``: the workers
    run with ``--durable-replicas 1`` and the killed primary is started again after the
    promotion (it rejoins as the replica its successor needs before a WAIT can succeed)."""
    name = (
        f"failover[resubmit={'on' if resubmit else 'off'},durable={'on' if durable else 'off'},"
        f"seed={'victim' if seed_victim else 'other'}"
        + (",worker-durable=on]" if worker_durable else "]")
    )
    queue = "fo"
    streams = keys.job_streams(queue, PARTITIONS)
    report = PhaseReport(name, jobs, 0)
    t0 = time.monotonic()
    with FailoverCluster(workdir, node_timeout_ms=1000) as cluster:
        victim = _node_of(cluster, streams[0])
        seed = victim if seed_victim else next(p for p in cluster.primary_ports() if p != victim)
        url = cluster.seeds_url([seed])
        durable_args = ["--durable-replicas", "1", "--durable-timeout-ms", "200"]
        durable_args = [*durable_args, "--metrics-port", "0"] if worker_durable else []
        workers = [
            WorkerProc(
                [
                    "--redis-url",
                    url,
                    "--queue",
                    queue,
                    "--partitions",
                    str(PARTITIONS),
                    "--scorer",
                    "noop",
                    "--consumer",
                    f"w{i}",
                    "--claim-idle-ms",
                    "1500",
                    "--block-ms",
                    "200",
                    "--metrics-port",
                    "-1",
                    "--max-deliveries",
                    "100",
                    *durable_args,
                ],
                workdir / f"w{i}.log",
            )
            for i in range(2)
        ]
        try:
            for w in workers:
                w.wait_ready(120)
            client = ScoringClient(
                cluster.seeds_url([*[p for p in cluster.ports if p != victim][:2], victim]),
                queue=queue,
                partitions=PARTITIONS,
                resubmit_after_s=3.0 if resubmit else None,
                max_submits=5,
                durable_replicas=1 if durable else 0,
                durable_timeout_ms=500,
            )
            handles: dict[int, object] = {}
            submit_errors = 0

            def kill() -> None:
                time.sleep(jobs / rate / 3)
                replica = cluster.kill_primary(victim)
                took = cluster.wait_promoted(replica, timeout_s=60)
                report.faults.append(
                    f"kill -9 primary :{victim}; replica :{replica} promoted in {took:.1f}s"
                )
                if worker_durable:
                    took = cluster.restart(victim)
                    report.faults.append(
                        f":{victim} restarted, in sync as a replica after {took:.1f}s"
                    )

            killer = threading.Thread(target=kill)
            killer.start()
            for i in range(jobs):
                while True:  # a producer retries a submit that raised (same job id)
                    try:
                        handles[i] = client.submit(_seqs(i), job_id=f"job-{i}", meta={"i": i})
                        break
                    except redis.RedisError:
                        submit_errors += 1
                        time.sleep(0.2)
                time.sleep(1.0 / rate)
            killer.join()
            report.accepted = len(handles)
            deadline = time.monotonic() + 45
            for i, h in handles.items():
                try:
                    res = client.raw_result(h, timeout=max(deadline - time.monotonic(), 0.1))
                except Exception:
                    report.lost += 1
                    continue
                if not res.ok:
                    report.errors += 1
                    continue
                got = np.asarray(res.seqs[0].logps, dtype=np.float32)
                if got.shape != _expected(i).shape or not np.allclose(got, _expected(i), atol=1e-5):
                    report.altered += 1
            report.duplicated = client.duplicates
            report.notes = {
                "resubmits": client.resubmits,
                "undurable": client.undurable,
                "submit_retries": submit_errors,
            }
            if worker_durable:
                report.notes["durable_shortfalls"] = sum(
                    metric(w.metrics_url, "scoring_durable_shortfalls_total", '{write="two_step"}')
                    for w in workers
                )
            after = client.score(_seqs(0), timeout=30)  # still serving after the failover
            assert after
            client.close()
            dead = [w.log_path.name for w in workers if w.proc.poll() is not None]
            report.notes["workers_alive"] = len(workers) - len(dead)
            assert not dead, f"workers died in the failover: {dead}"
        finally:
            for w in workers:
                if w.proc.poll() is None:
                    w.proc.terminate()
            for w in workers:
                try:
                    w.proc.wait(30)
                except Exception:
                    w.proc.kill()
    report.time_s = time.monotonic() - t0
    REPORTS.append(report.as_row())
    return report


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "resubmit,durable,seed_victim",
    CONFIGS,
    ids=[f"resub-{r}-durable-{d}-seedvictim-{s}" for r, d, s in CONFIGS],
)
def test_failover(
    tmp_path: Path, faults_full: bool, resubmit: bool, durable: bool, seed_victim: bool
) -> None:
    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        pytest.skip("redis-server/redis-cli not on PATH")
    if not faults_full and (resubmit, durable, seed_victim) != QUICK:
        pytest.skip("make test-faults runs every failover configuration")
    report = run_failover(
        tmp_path,
        resubmit=resubmit,
        durable=durable,
        seed_victim=seed_victim,
        jobs=600 if faults_full else 200,
        rate=100.0,
    )
    if resubmit:
        assert report.lost == 0, report
    assert report.altered == 0, report


@pytest.mark.timeout(600)
def test_failover_with_durable_workers(tmp_path: Path, faults_full: bool) -> None:
    """Workers with ``--durable-replicas 1``: partition 1 and 2's results go to the reply node
    (the victim), whose promoted replica has no replica of its own until the victim is back;
    meanwhile those writes fall short and stay unacked. Nothing is lost, every worker lives."""
    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        pytest.skip("redis-server/redis-cli not on PATH")
    if not faults_full:
        pytest.skip("make test-faults runs it")
    report = run_failover(
        tmp_path,
        resubmit=True,
        durable=False,
        seed_victim=False,
        jobs=600,
        rate=100.0,
        worker_durable=True,
    )
    assert report.lost == 0 and report.altered == 0, report
