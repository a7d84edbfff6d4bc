"""Test helpers for the client tests (no tests here).

``Responder`` is a test double of the worker for unit tests of client logic: it reads job streams
with XREADGROUP, answers with ``protocol.encode_result`` (log-prob of token t = -t/100 for every
scored token) and acks. Per-job behaviour comes from the job's ``meta``: ``{"fail": code}`` answers
an error result, ``{"dup": n}`` writes the result n extra times, ``{"drop": true}`` never answers.
``OutstandingSampler`` measures jobs in flight from the stream side (group lag + pending).
``JobTap`` reads back the job payloads added to a queue's streams (what went on the wire).
"""

from __future__ import annotations

import threading
import time
from array import array
from typing import Any

import msgpack
import redis

from worker import keys, protocol

GROUP = keys.DEFAULT_GROUP


def expected_logps(tokens: list[int], prompt_len: int) -> list[float]:
    """What ``Responder`` answers for a prompt_len sequence."""
    return [-t / 100 for t in tokens[prompt_len:]]


def outstanding(client: redis.Redis, streams: list[str], group: str = GROUP) -> int:
    """Jobs not yet answered, from the stream side: group lag + pending over all streams.

    All streams are read in one MULTI/EXEC: read one by one, a job acked on a stream already
    read and its successor submitted on a stream read later would both be counted.
    """
    pipe = client.pipeline(transaction=True)
    for stream in streams:
        pipe.xinfo_groups(stream)
    total = 0
    for groups in pipe.execute(raise_on_error=False):
        if isinstance(groups, Exception):  # no such stream (yet)
            continue
        for g in groups:
            name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
            if name == group:
                total += int(g.get("lag") or 0) + int(g.get("pending") or 0)
    return total


class Responder:
    """A worker double in a thread (see the module docstring)."""

    def __init__(
        self,
        url: str,
        streams: list[str],
        *,
        delay_s: float = 0.0,
        count: int = 16,
        poison: int | None = None,
    ):
        self.client = redis.Redis.from_url(url)
        self.poison = poison  # a job holding this token id is answered bad_request
        self.streams = streams
        self.delay_s = delay_s
        self.count = count
        self.answered = 0
        self.seen_jobs: list[protocol.Job] = []
        self._stop = threading.Event()
        for s in streams:
            try:
                self.client.xgroup_create(s, GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Responder:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.client.close()

    def __enter__(self) -> Responder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _answer(self, job: protocol.Job) -> protocol.Result:
        meta = job.meta if isinstance(job.meta, dict) else {}
        if meta.get("fail"):
            return protocol.error_result(
                job.id, meta["fail"], f"told to fail with {meta['fail']}", meta=job.meta
            )
        if self.poison is not None and any(self.poison in s.tokens for s in job.seqs):
            return protocol.error_result(job.id, "bad_request", f"token {self.poison} refused")
        seqs = []
        for s in job.seqs:
            toks = list(s.tokens)
            if s.mask is not None:
                scored = [t for t, m in zip(toks, s.mask, strict=True) if m]
            else:
                scored = toks[s.prompt_len :]
            seqs.append(
                protocol.SeqResult(
                    logps=array("f", [-t / 100 for t in scored]),
                    reward=float(len(toks)) if job.mode in ("reward", "both") else None,
                )
            )
        return protocol.Result(
            id=job.id, ok=True, seqs=seqs, meta=job.meta, info={"backend": "double"}
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            reply = self.client.xreadgroup(
                GROUP, "double", {s: ">" for s in self.streams}, count=self.count, block=50
            )
            for stream, entries in reply or []:
                for entry_id, fields in entries:
                    job = protocol.decode_job(fields[protocol.PAYLOAD_FIELD])
                    self.seen_jobs.append(job)
                    if self.delay_s:
                        time.sleep(self.delay_s)
                    meta = job.meta if isinstance(job.meta, dict) else {}
                    if meta.get("drop"):
                        self.client.xack(stream, GROUP, entry_id)
                        continue
                    payload = protocol.encode_result(self._answer(job))
                    pipe = self.client.pipeline(transaction=True)  # result + ack atomically
                    for _ in range(1 + int(meta.get("dup", 0))):
                        pipe.xadd(job.reply_to, {protocol.PAYLOAD_FIELD: payload})
                    pipe.xack(stream, GROUP, entry_id)
                    pipe.execute()
                    self.answered += 1


class OutstandingSampler:
    """Samples ``outstanding()`` every few ms in a thread; ``peak`` is the maximum seen."""

    def __init__(self, url: str, streams: list[str], interval_s: float = 0.005) -> None:
        self.client = redis.Redis.from_url(url)
        self.streams = streams
        self.interval_s = interval_s
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, outstanding(self.client, self.streams))
            self.samples += 1
            time.sleep(self.interval_s)

    def __enter__(self) -> OutstandingSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)
        self.client.close()


class JobTap:
    """The job payloads added to ``streams`` from now on, as sent (``payloads``: XRANGE).

    A consumer group of its own, made at the streams' end and never read, holds the workers'
    trimming (``streams.trim_acked``: entries every group has read) off the new entries until
    ``close``. Only for a queue that has a worker or its group already: the tap's group would
    make an unknown queue look served.
    """

    NAME = "tap"

    def __init__(self, url: str, streams: list[str]) -> None:
        self.client = redis.Redis.from_url(url)
        self.streams = streams
        self.start: dict[str, bytes] = {}
        for s in streams:
            self.client.xgroup_create(s, self.NAME, id="$", mkstream=True)
            for g in self.client.xinfo_groups(s):
                if g["name"] in (self.NAME, self.NAME.encode()):
                    self.start[s] = g["last-delivered-id"]

    def payloads(self) -> list[bytes]:
        """The payloads added since the tap was made, stream by stream, in order."""
        out = []
        for s in self.streams:
            start = self.start[s]
            start = start.decode() if isinstance(start, bytes) else start
            for _, fields in self.client.xrange(s, min=f"({start}"):
                out.append(fields[protocol.PAYLOAD_FIELD])
        return out

    def bodies(self) -> list[dict[str, Any]]:
        """The payloads as their msgpack maps (``prefix`` and ``tokens`` as bytes)."""
        return [msgpack.unpackb(p, raw=False) for p in self.payloads()]

    def close(self) -> None:
        for s in self.streams:
            self.client.xgroup_destroy(s, self.NAME)
        self.client.close()

    def __enter__(self) -> JobTap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
