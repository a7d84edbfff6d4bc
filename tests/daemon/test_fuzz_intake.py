"""Hostile input at the daemon's intake: random and mutated payloads XADDed to a live worker's
stream never crash or wedge it, and each ends as a result (an error result when it names a reply
stream and an id) or a dead letter; valid jobs sent afterwards are still answered. Jobs over
``--max-payload-bytes`` get ``bad_request`` wherever their ``id``/``reply_to`` sit in the map.

The payloads come from a seeded generator (random bytes, mutated valid jobs, wrong schemas, huge
headers, entries without the ``payload`` field), not hypothesis: one live worker answers them all
in one go. ``SCORING_FUZZ_INTAKE=N`` sets how many (default 150).
"""

from __future__ import annotations

import os
import random
import signal
import struct
from pathlib import Path

import msgpack
import pytest
import redis

from tests.faults.servers import RedisServer, have_redis_server
from tests.support.daemon import WorkerProc, wait_until
from worker import keys, protocol
from worker.protocol import encode_job

pytestmark = [
    pytest.mark.redis,
    pytest.mark.slow,
    pytest.mark.skipif(not have_redis_server(), reason="needs redis-server"),
]

N_PAYLOADS = int(os.environ.get("SCORING_FUZZ_INTAKE", "150"))
MAX_PAYLOAD = 16384  # --max-payload-bytes of the worker: far above every hostile entry


def _valid(rng: random.Random, reply: str, i: int) -> bytes:
    seqs = []
    for _ in range(rng.randint(1, 3)):
        n = rng.randint(2, 12)
        seqs.append({"tokens": [rng.randrange(1000) for _ in range(n)], "prompt_len": 1})
    return encode_job(f"fz-{i}", rng.choice(protocol.MODES), reply, seqs, meta={"i": i})


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        pos = rng.randrange(len(b)) if b else 0
        if op == 0 and b:
            b[pos] = rng.randrange(256)
        elif op == 1:
            b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 6)))
        elif op == 2 and b:
            del b[pos : pos + rng.randint(1, 6)]
        elif op == 3:
            b = b[: max(pos, 1)]
        else:
            b[pos:pos] = rng.choice([b"\xdd", b"\xc6", b"\xdb", b"\xdf"]) + struct.pack(
                ">I", rng.choice([2**31, 2**32 - 1, 4 * 1024 * 1024])
            )
    return bytes(b)


def hostile_entries(seed: int, n: int, reply: str) -> list[dict[bytes, bytes]]:
    """``n`` hostile stream entries (field maps) of mixed kinds."""
    rng = random.Random(seed)
    out: list[dict[bytes, bytes]] = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            payload = bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
        elif kind in (1, 2):
            payload = _mutate(rng, _valid(rng, reply, i))
        elif kind == 3:  # valid msgpack, wrong schema, addressable
            body = {"v": 1, "id": f"fz-{i}", "reply_to": reply, "mode": "reference"}
            body["seqs"] = rng.choice(
                [[], [{"tokens": "abc"}], [{"tokens": [1], "prompt_len": 1}], 5, [{}], None]
            )
            payload = msgpack.packb(body)
        elif kind == 4:  # semantically bad: token ids outside the vocab, mode unknown, too long
            body = msgpack.unpackb(_valid(rng, reply, i))
            body.update(
                rng.choice(
                    [
                        {"mode": "nope"},
                        {"seqs": [{"tokens": [10**9, 2**31 - 1], "prompt_len": 1}]},
                        {"seqs": [{"tokens": [-5, 3, 4], "prompt_len": 1}]},
                        {"temperature": 0.0},
                        {"deadline_ms": 1},
                    ]
                )
            )
            payload = msgpack.packb(body, use_bin_type=True)
        else:  # entries without a payload field, or with extra junk fields
            if rng.random() < 0.5:
                out.append({b"junk": bytes(rng.randrange(256) for _ in range(8))})
                continue
            payload = _valid(rng, reply, i)
            out.append({b"payload": payload, b"extra": b"x" * 10})
            continue
        out.append({b"payload": payload})
    return out


def oversized_payloads(reply: str) -> dict[str, bytes]:
    """Job id -> a job payload over ``MAX_PAYLOAD``: big tokens bin, big int array, big unknown
    key, with ``id``/``reply_to`` before or after the big value."""
    big_bin = [{"tokens": struct.pack("<5000i", *range(5000)), "prompt_len": 1}]
    big_array = [{"tokens": list(range(70_000, 80_000)), "prompt_len": 1}]
    out = {"over-front": encode_job("over-front", "reference", reply, big_bin, meta={"k": 1})}
    back = {"seqs": big_array, "v": 1, "mode": "reference", "id": "over-back", "reply_to": reply}
    out["over-back"] = msgpack.packb(back, use_bin_type=True)
    junk = {"junk": "x" * MAX_PAYLOAD, "v": 1, "mode": "reference", "seqs": big_bin[:0]}
    junk.update(id="over-junk", reply_to=reply)
    out["over-junk"] = msgpack.packb(junk, use_bin_type=True)
    assert all(len(p) > MAX_PAYLOAD for p in out.values())
    return out


@pytest.mark.timeout(240)
def test_hostile_entries_end_as_results_or_dead_letters(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    admin = server.admin()
    queue = "fuzz"
    stream = keys.job_streams(queue)[0]
    reply = keys.reply_stream(stream, "fuzzer")
    dead = keys.dead_letter_stream(stream)
    worker = WorkerProc(
        ["--redis-url", server.url, "--queue", queue, "--scorer", "noop", "--metrics-port", "-1",
         "--block-ms", "200", "--claim-idle-ms", "1000", "--max-deliveries", "2",
         "--max-tokens-per-job", "4096", "--max-payload-bytes", str(MAX_PAYLOAD)],
        tmp_path / "worker.log",
    )  # fmt: skip
    try:
        worker.wait_ready()
        entries = hostile_entries(1234, N_PAYLOADS, reply)
        sent: dict[str, dict[bytes, bytes]] = {}
        for fields in entries:
            sent[admin.xadd(stream, fields).decode()] = fields
        # Over --max-payload-bytes, address before or after the big value: answered, not dropped.
        oversized = oversized_payloads(reply)
        for payload in oversized.values():
            sent[admin.xadd(stream, {"payload": payload}).decode()] = {b"payload": payload}
        # Valid jobs after the garbage: the worker is not wedged.
        good = []
        for i in range(5):
            payload = encode_job(
                f"good-{i}", "reference", reply, [{"tokens": [1, 2, 3], "prompt_len": 1}]
            )
            admin.xadd(stream, {"payload": payload})
            good.append(f"good-{i}")

        def results() -> dict[str, list[protocol.Result]]:
            out: dict[str, list[protocol.Result]] = {}
            for _id, f in admin.xrange(reply):
                r = protocol.decode_result(f[b"payload"])
                out.setdefault(r.id, []).append(r)
            return out

        wait_until(lambda: set(good) <= set(results()), 120, what="valid jobs answered")
        wait_until(
            lambda: admin.xpending(stream, "scoring")["pending"] == 0, 60, what="all entries acked"
        )
        assert worker.proc.poll() is None, worker.log()[-2000:]
        got = results()
        dead_ids = {f[b"id"].decode() for _i, f in admin.xrange(dead)}
        other_keys: dict[str, set[str]] = {}
        unaccounted = []
        for entry_id, fields in sent.items():
            if entry_id in dead_ids:
                continue
            env = protocol.peek_envelope(fields.get(b"payload", b""))
            # No readable id: the result carries the stream entry id (docs/protocol.md).
            job_id, to = env.get("id", entry_id), env.get("reply_to")
            if to == reply and job_id in got:
                continue
            if job_id and to and to != reply:  # a mutated reply_to: the answer went there
                if to not in other_keys:
                    try:
                        other_keys[to] = {
                            protocol.decode_result(f[b"payload"]).id for _i, f in admin.xrange(to)
                        }
                    except (redis.ResponseError, protocol.ProtocolError):
                        other_keys[to] = set()
                if job_id in other_keys[to]:
                    continue
            unaccounted.append((entry_id, fields))
        assert not unaccounted, f"{len(unaccounted)} entries vanished, e.g. {unaccounted[:3]}"
        assert all(r.ok for g in good for r in got[g])
        for job_id, payload in oversized.items():
            assert [r.code for r in got[job_id]] == ["bad_request"], job_id
            message = got[job_id][0].error["message"]
            assert message == f"payload is {len(payload)} bytes, over the limit of {MAX_PAYLOAD}"
        errors = [r for rs in got.values() for r in rs if not r.ok]
        assert errors, "hostile input should produce error results"
        assert {r.code for r in errors} <= set(protocol.ERROR_CODES)
        worker.signal(signal.SIGTERM)
        assert worker.wait_exit(30) == 0
        assert "Traceback" not in worker.log()
    finally:
        worker.stop()
        server.stop()
