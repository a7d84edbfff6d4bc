"""A soak run: one worker under a steady mix of jobs for a long time; does anything drift?

``make soak DURATION=30m RATE=20`` (= ``python -m worker.devtools.bench.soak --duration 30m --rate
20``). Starts its own ``redis-server`` (AOF, ``appendfsync always``) on a free port and one
worker with the **no-op scorer** (the daemon, the streams and the client are what soak; a
model's memory is the executor's business, measured by ``make bench``). A producer sends, per
second, ``--rate`` jobs: 85% valid (through ``ScoringClient``, with resubmission on), 5% bad
(a payload without sequences: ``bad_request``), 5% expired (a deadline in the past) and 5%
poison (bytes that are not msgpack: a dead letter). Along the way the worker is restarted
(SIGTERM, at 25% of the run) and Redis is killed and restarted on its AOF (at 50%).

Every ``--sample-s`` it samples the worker's RSS, open fds and threads (``/proc``), Redis
``used_memory`` and key count. The drift table compares the first and the last sample of the
window after warm-up (from the last disruption plus ``--warmup-frac`` of the run to the end);
the PNG plots every series over the whole run (matplotlib, the ``soak`` extra). Also reported:
valid jobs lost (no result by the end), keys without a TTL, dead letters (the stream is capped
with ``MAXLEN``; see docs/guarantees.md). Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgpack
import redis

from worker import keys
from worker.processes.local import LocalWorker, free_port

SERIES = ("rss_mib", "fds", "threads", "redis_used_mib", "redis_keys")


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``2h`` -> seconds."""
    text = text.strip().lower()
    unit = {"s": 1, "m": 60, "h": 3600}.get(text[-1:])
    return float(text[:-1]) * unit if unit else float(text)


class Server:
    """An own ``redis-server`` with AOF on, killable and restartable on the same data."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.port = workdir, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = shutil.which("redis-server") or "redis-server"
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=self.port).ping():
                    return
            except redis.RedisError:
                time.sleep(0.1)
        raise RuntimeError("redis-server did not start")

    def kill_restart(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def _proc_stats(pid: int) -> tuple[float, int, int]:
    """(RSS MiB, open fds, threads) of ``pid`` from ``/proc``."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kib = int(fields["VmRSS"].split()[0])
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd")), int(fields["Threads"])


class Soak:
    """The run: server, worker, producer, sampler, events; :meth:`run` returns the report."""

    def __init__(self, duration_s: float, rate: float, sample_s: float, workdir: Path) -> None:
        self.duration_s, self.rate, self.sample_s = duration_s, rate, sample_s
        self.workdir = workdir
        self.server = Server(workdir)
        self.queue = "soak"
        self.stream = keys.job_streams(self.queue)[0]
        self.worker: LocalWorker | None = None
        self.samples: list[dict[str, float]] = []
        self.events: list[tuple[float, str]] = []
        self.counts = {"valid": 0, "bad": 0, "expired": 0, "poison": 0, "lost": 0, "answered": 0}
        self._stop = threading.Event()
        self._t0 = 0.0

    def _start_worker(self) -> None:
        self.worker = LocalWorker(
            ["--scorer", "noop",
             "--redis-url", f"redis://127.0.0.1:{self.server.port}/0", "--queue", self.queue,
             "--consumer", "soak-1", "--metrics-port", "-1", "--block-ms", "200",
             "--claim-idle-ms", "3000", "--max-deliveries", "3"],
            log_path=self.workdir / "worker.log", append=True,
        )  # fmt: skip

    def _sample(self) -> None:
        while not self._stop.wait(self.sample_s):
            row: dict[str, float] = {"t": time.monotonic() - self._t0}
            try:
                assert self.worker is not None
                row["rss_mib"], row["fds"], row["threads"] = _proc_stats(self.worker.pid)
                with redis.Redis(port=self.server.port, socket_timeout=5) as r:
                    row["redis_used_mib"] = int(r.info("memory")["used_memory"]) / 2**20
                    row["redis_keys"] = int(r.dbsize())
            except (OSError, KeyError, redis.RedisError):
                continue  # mid-restart
            self.samples.append(row)

    def _produce(self) -> None:
        from worker.client import ScoringClient, ScoringTimeout

        rng = random.Random(0)
        pending: deque[Any] = deque()
        url = f"redis://127.0.0.1:{self.server.port}/0"
        with ScoringClient(
            url, queue=self.queue, resubmit_after_s=15.0, max_submits=5,
            wait_for_unknown_queue=True,  # the first worker may not have made its group yet
        ) as client:  # fmt: skip
            raw = redis.Redis(port=self.server.port)
            i, start = 0, time.monotonic()
            while not self._stop.is_set():
                due = start + i / self.rate
                time.sleep(max(due - time.monotonic(), 0))
                i += 1
                kind = rng.choices(["valid", "bad", "expired", "poison"], [85, 5, 5, 5])[0]
                seqs = [{"tokens": [rng.randrange(1, 999) for _ in range(48)], "prompt_len": 16}]
                try:
                    if kind == "valid":
                        pending.append((time.monotonic(), client.submit(seqs)))
                    elif kind == "expired":
                        client.submit(seqs, deadline_ms=int(time.time() * 1000) - 1000)
                    elif kind == "bad":
                        body = {
                            "v": 1,
                            "id": f"bad-{i}",
                            "mode": "reference",
                            "reply_to": client.reply_stream,
                        }
                        raw.xadd(self.stream, {b"payload": msgpack.packb(body)})
                    else:
                        raw.xadd(self.stream, {b"payload": b"\xc1poison"})
                    self.counts[kind] += 1
                except redis.RedisError:
                    time.sleep(0.2)  # Redis restarting: this tick is skipped
                while pending and time.monotonic() - pending[0][0] > 5.0:
                    self._collect(client, pending.popleft()[1], 0.01, ScoringTimeout)
            for _, handle in pending:  # the tail: give it time
                self._collect(client, handle, 60.0, ScoringTimeout)
            raw.close()

    def _collect(
        self, client: Any, handle: Any, timeout: float, timeout_exc: type[BaseException]
    ) -> None:
        try:
            client.raw_result(handle, timeout=timeout)
            self.counts["answered"] += 1
        except timeout_exc:
            late = client.raw_result(handle, timeout=60.0) if timeout < 1 else None
            if late is None:
                self.counts["lost"] += 1
            else:
                self.counts["answered"] += 1
        except redis.RedisError:
            self.counts["lost"] += 1

    def _events(self) -> None:
        plan = [
            (0.25, "worker restart (SIGTERM, drain, start)"),
            (0.50, "redis kill -9 + restart on AOF"),
        ]
        for frac, what in plan:
            if self._stop.wait(max(self._t0 + frac * self.duration_s - time.monotonic(), 0)):
                return
            self.events.append((time.monotonic() - self._t0, what))
            if what.startswith("worker"):
                assert self.worker is not None
                self.worker.stop(60)
                self._start_worker()
            else:
                self.server.kill_restart()

    def run(self) -> dict[str, Any]:
        self.server.start()
        self._start_worker()
        self._t0 = time.monotonic()
        threads = [threading.Thread(target=f, daemon=True) for f in (self._sample, self._events)]
        producer = threading.Thread(target=self._produce, daemon=True)
        for t in [*threads, producer]:
            t.start()
        try:
            time.sleep(self.duration_s)
        finally:
            self._stop.set()
            producer.join(180)
            for t in threads:
                t.join(10)
        alive = self.worker is not None and self.worker.poll() is None
        with redis.Redis(port=self.server.port) as r:
            queue_keys = {self.stream, keys.dead_letter_stream(self.stream)}  # the queue itself
            no_ttl = [
                k.decode()
                for k in r.scan_iter(count=1000)
                if r.ttl(k) == -1 and k.decode() not in queue_keys
            ]
            stream_len = int(r.xlen(self.stream))
            dead = (
                r.xlen(keys.dead_letter_stream(self.stream))
                if r.exists(keys.dead_letter_stream(self.stream))
                else 0
            )
        if self.worker is not None:
            self.worker.stop(60)
        self.server.stop()
        return {
            "duration_s": self.duration_s,
            "rate": self.rate,
            "counts": self.counts,
            "events": self.events,
            "samples": self.samples,
            "drift": self.drift(),
            "keys_without_ttl": no_ttl,
            "dead_letters": dead,
            "job_stream_len": stream_len,
            "worker_alive": alive,
        }

    def window_start(self) -> float:
        """After the last disruption plus warm-up (10% of the run by default)."""
        last = max((t for t, _ in self.events), default=0.0)
        return last + self.warmup_s

    warmup_s = 0.0

    def drift(self) -> dict[str, dict[str, float]]:
        """Per series: first and last sample of the window, and the change (% and absolute)."""
        window = [s for s in self.samples if s["t"] >= self.window_start()]
        out: dict[str, dict[str, float]] = {}
        if len(window) < 2:
            return out
        for name in SERIES:
            first, last = window[0][name], window[-1][name]
            peak = max(s[name] for s in window)
            pct = (last - first) / first * 100 if first else 0.0
            out[name] = {"start": first, "end": last, "max": peak, "drift_pct": round(pct, 2)}
        return out


def table(report: dict[str, Any]) -> str:
    """The drift table (markdown) plus the counters."""
    lines = ["| series | start | end | max | drift |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, d in report["drift"].items():
        lines.append(
            f"| {name} | {d['start']:.1f} | {d['end']:.1f} | {d['max']:.1f} | "
            f"{d['drift_pct']:+.1f}% |"
        )
    c = report["counts"]
    lines += [
        "",
        f"jobs: {c['valid']} valid ({c['answered']} answered, {c['lost']} lost), {c['bad']} bad, "
        f"{c['expired']} expired, {c['poison']} poison; dead letters {report['dead_letters']}; "
        f"job stream length {report['job_stream_len']}; other keys without TTL: "
        f"{report['keys_without_ttl']}; worker alive: {report['worker_alive']}",
        "events: " + "; ".join(f"{t:.0f}s {what}" for t, what in report["events"]),
    ]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path, window_start: float) -> bool:
    """Every series over time, one panel each; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    samples = report["samples"]
    fig, axes = plt.subplots(len(SERIES), 1, figsize=(9, 2.0 * len(SERIES)), sharex=True)
    ts = [s["t"] / 60 for s in samples]
    for ax, name in zip(axes, SERIES, strict=True):
        ax.plot(ts, [s[name] for s in samples], lw=1)
        ax.set_ylabel(name, fontsize=8)
        for t, _ in report["events"]:
            ax.axvline(t / 60, color="red", lw=0.8, ls="--")
        ax.axvspan(window_start / 60, ts[-1] if ts else 0, color="green", alpha=0.06)
    axes[-1].set_xlabel("minutes (red: restarts; green: drift window)")
    fig.suptitle(f"soak: {report['duration_s'] / 60:.0f} min at {report['rate']} jobs/s")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    """Run the soak, print the table, write JSON and PNG; exit 1 when a target is missed."""
    parser = argparse.ArgumentParser(prog="python -m worker.devtools.bench.soak")
    parser.add_argument("--duration", default="30m", help="e.g. 60s, 30m, 2h (default 30m)")
    parser.add_argument("--rate", type=float, default=20.0, help="jobs per second (default 20)")
    parser.add_argument("--sample-s", type=float, default=0.0, help="0 = duration / 200")
    parser.add_argument("--warmup-frac", type=float, default=0.1)
    parser.add_argument("--out", default="build/soak", help="directory for soak.json, soak.png")
    args = parser.parse_args(argv)
    duration = parse_duration(args.duration)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        soak = Soak(duration, args.rate, args.sample_s or max(duration / 200, 1.0), Path(tmp))
        soak.warmup_s = args.warmup_frac * duration
        report = soak.run()
    text = table(report)
    print(text)
    (out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    if plot(report, out / "soak.png", soak.window_start()):
        print(f"plot: {out / 'soak.png'}")
    else:
        print("plot: skipped (pip install 'scoring-worker[soak]' for matplotlib)")
    print(f"report: {out / 'soak.json'}")
    d = report["drift"]
    ok = (
        report["counts"]["lost"] == 0
        and report["worker_alive"]
        and not report["keys_without_ttl"]
        and all(
            d.get(k, {}).get("end", 0) <= d.get(k, {}).get("start", 0) for k in ("fds", "threads")
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
