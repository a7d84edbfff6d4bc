"""Security against a real redis-server started by the test: ACL users limited to the commands and
keys they need (the rules of ``docs/security.md``), clear NOPERM errors, secrets kept out of logs
and metrics, metrics bound to loopback by default."""

from __future__ import annotations

import re
import signal
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.faults.servers import RedisServer, have_redis_server
from tests.support.daemon import WorkerProc, wait_until
from worker import keys
from worker.client import ScoringClient, UnknownQueueError

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(not have_redis_server(), reason="needs redis-server"),
]

ADMIN_PASSWORD = "adm-Secr3t-pw"
WORKER_PASSWORD = "wrk-9f3c1e-Secr3t"
PRODUCER_PASSWORD = "prd-77a0b2-Secr3t"

# The rules documented in docs/security.md (keep the two in sync).
WORKER_ACL = (
    "resetkeys ~scoring:* resetchannels -@all "
    "+ping +hello +client|setname +client|setinfo +info +eval "
    "+xreadgroup +xautoclaim +xclaim +xpending +xrange +xack +xadd +ttl +expire "
    "+xgroup|create +xgroup|delconsumer +xinfo|groups +xinfo|consumers +xlen "
    "+hset +pexpire +zadd +zremrangebyscore "  # the heartbeat (scoring-worker info)
    "+hgetall +hincrby"  # the hand-back counters a draining worker bumps and the others watch
)
PRODUCER_ACL = (
    "resetkeys %W~scoring:*:jobs ~scoring:*:replies:* %R~scoring:*:workers resetchannels -@all "
    "+ping +hello +client|setname +client|setinfo +xadd +xread +xdel +expire +del "
    "+zcount "  # the queue rule: does a worker serve the queue?
    "(%R~scoring:*:jobs +xinfo|groups)"  # ... or did one (a group)? read-only, that one command
)
NOBODY_ACL = "resetkeys ~scoring:* resetchannels -@all +ping +hello +client|setname +info +xlen"


def _setuser(admin: redis.Redis, name: str, password: str, rules: str) -> None:
    admin.execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}", *rules.split())


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server with a default-user password and worker/producer/nobody ACL users."""
    server = RedisServer(tmp_path_factory.mktemp("acl-redis"), password=ADMIN_PASSWORD).start()
    admin = server.admin()

    def rules(r: str) -> str:  # redis 7.0 has no CLIENT SETINFO (7.2+): SETUSER rejects it
        return r if server_has_setinfo else r.replace(" +client|setinfo", "")

    try:
        admin.execute_command("ACL", "DRYRUN", "default", "CLIENT", "SETINFO", "LIB-NAME", "x")
        server_has_setinfo = True
    except redis.ResponseError:
        server_has_setinfo = False
    _setuser(admin, "worker", WORKER_PASSWORD, rules(WORKER_ACL))
    _setuser(admin, "producer", PRODUCER_PASSWORD, rules(PRODUCER_ACL))
    _setuser(admin, "nobody", "nobody-pw", NOBODY_ACL)
    try:
        yield server
    finally:
        server.stop()


def _worker(url: str, queue: str, tmp_path: Path, *extra: str, name: str = "w") -> WorkerProc:
    args = [
        "--queue", queue, "--scorer", "noop", "--metrics-port", "0",
        "--block-ms", "200", "--claim-idle-ms", "1000", "--max-deliveries", "2", *extra,
    ]  # fmt: skip
    return WorkerProc(args, tmp_path / f"{name}.log", env={"SCORING_REDIS_URL": url})


def _denials(admin: redis.Redis, users: set[str]) -> list[dict]:
    return [e for e in admin.acl_log() if e.get("username") in users]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_worker_and_producer_acl_users_work_end_to_end(
    acl_server: RedisServer, tmp_path: Path, key_prefix: str
) -> None:
    admin = acl_server.admin()
    admin.acl_log_reset()
    worker = _worker(acl_server.user_url("worker", WORKER_PASSWORD), key_prefix, tmp_path)
    try:
        worker.wait_ready()
        with ScoringClient(
            acl_server.user_url("producer", PRODUCER_PASSWORD), queue=key_prefix
        ) as client:
            handles = [
                client.submit([{"tokens": [1, 2, 3 + i], "prompt_len": 1}]) for i in range(5)
            ]
            bad = client.submit([{"tokens": [1, 2, 3], "prompt_len": 1}], mode="reward")
            results = [client.result(h, timeout=30) for h in handles]
            assert [len(r.seqs[0].logps) for r in results] == [2] * 5
            assert client.raw_result(bad, timeout=30).ok  # noop serves every mode
        # The producer's reply stream was created, read, and deleted by the producer user.
        assert not list(admin.scan_iter(match=f"scoring:{{{key_prefix}}}:replies:*"))
        # The worker user wrote its heartbeat (what `scoring-worker info` lists).
        assert [m.decode() for m in admin.zrange(keys.workers_index(key_prefix), 0, -1)] != []
        worker.signal(signal.SIGTERM)
        assert worker.wait_exit(30) == 0
        # What Redis keeps: the worker asks CONFIG GET once (it says whether RDB is on where
        # allowed), then reads INFO only (docs/operations.md#what-redis-must-keep).
        denials = _denials(admin, {"worker", "producer"})
        config_get = [e for e in denials if e["object"] == "config|get"]
        assert [(e["username"], e["count"]) for e in config_get] == [("worker", 1)]
        assert [e for e in denials if e["object"] != "config|get"] == []
        assert "Traceback" not in worker.log()
    finally:
        worker.stop()


@pytest.mark.timeout(60)
def test_producer_user_cannot_read_jobs_or_touch_other_keys(acl_server: RedisServer) -> None:
    producer = redis.Redis.from_url(acl_server.user_url("producer", PRODUCER_PASSWORD))
    stream = keys.job_streams("acl-confined")[0]
    producer.xadd(stream, {"payload": b"x"})  # write-only on job streams
    with pytest.raises(redis.exceptions.NoPermissionError, match="key"):
        producer.xread({stream: "0-0"})  # cannot read other producers' jobs
    with pytest.raises(redis.exceptions.NoPermissionError):
        producer.xadd("other:stream", {"a": "b"})
    with pytest.raises(redis.exceptions.NoPermissionError):
        producer.xreadgroup("scoring", "c", {stream: ">"})
    with pytest.raises(redis.exceptions.NoPermissionError):
        producer.flushall()
    acl_server.admin().delete(stream)


@pytest.mark.timeout(60)
def test_worker_user_cannot_write_outside_scoring_keys(acl_server: RedisServer) -> None:
    w = redis.Redis.from_url(acl_server.user_url("worker", WORKER_PASSWORD))
    with pytest.raises(redis.exceptions.NoPermissionError):
        w.xadd("elsewhere:stream", {"a": "b"})
    with pytest.raises(redis.exceptions.NoPermissionError):
        w.set("scoring:x", "1")  # only stream commands
    with pytest.raises(redis.exceptions.NoPermissionError):
        w.config_get("*")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_hostile_reply_to_cannot_escape_the_acl_key_space(
    acl_server: RedisServer, tmp_path: Path, key_prefix: str
) -> None:
    """A job whose reply_to names a key outside ``scoring:*``: the worker cannot write there, the
    job is never acked unanswered, and it ends in the dead-letter stream."""
    from worker.protocol import encode_job

    admin = acl_server.admin()
    stream = keys.job_streams(key_prefix)[0]
    worker = _worker(acl_server.user_url("worker", WORKER_PASSWORD), key_prefix, tmp_path)
    try:
        worker.wait_ready()
        payload = encode_job(
            "evil", "reference", "victim:stream", [{"tokens": [1, 2], "prompt_len": 1}]
        )
        admin.xadd(stream, {"payload": payload})
        dead = keys.dead_letter_stream(stream)
        wait_until(lambda: admin.xlen(dead) >= 1, 60, what="dead letter")
        assert not admin.exists("victim:stream")
        assert admin.xpending(stream, "scoring")["pending"] == 0
        assert worker.proc.poll() is None  # still serving
    finally:
        worker.stop()
        for key in admin.scan_iter(match=f"*{key_prefix}*"):
            admin.delete(key)


@pytest.mark.timeout(60)
def test_worker_without_permission_exits_with_one_clear_line(
    acl_server: RedisServer, tmp_path: Path
) -> None:
    worker = _worker(acl_server.user_url("nobody", "nobody-pw"), "acl-nobody", tmp_path)
    try:
        assert worker.wait_exit(45) == 2
        log = worker.log()
        refused = r"error: redis refused the command: .*no permissions to run the '\S+' command"
        assert re.search(refused, log), log
        assert "Traceback" not in log
    finally:
        worker.stop()


@pytest.mark.timeout(60)
def test_the_producer_user_applies_the_queue_rule(acl_server: RedisServer, key_prefix: str) -> None:
    admin = acl_server.admin()
    admin.acl_log_reset()
    url = acl_server.user_url("producer", PRODUCER_PASSWORD)
    with (  # never served: refused, nothing written
        ScoringClient(url, queue=key_prefix) as client,
        pytest.raises(UnknownQueueError) as info,
    ):
        client.submit([{"tokens": [1, 2, 3], "prompt_len": 1}])
    assert info.value.queues is None  # no +scan: the refusal cannot list the queues
    assert admin.exists(keys.job_streams(key_prefix)[0]) == 0
    assert {e["object"] for e in _denials(admin, {"producer"})} == {"scan"}
    admin.acl_log_reset()
    admin.xgroup_create(keys.job_streams(key_prefix)[0], "scoring", id="$", mkstream=True)
    with ScoringClient(url, queue=key_prefix) as client:  # a group, no worker: the job waits
        client.submit([{"tokens": [1, 2, 3], "prompt_len": 1}])
    assert admin.xlen(keys.job_streams(key_prefix)[0]) == 1
    assert _denials(admin, {"producer"}) == []
    admin.delete(keys.job_streams(key_prefix)[0])


@pytest.mark.timeout(60)
def test_producer_without_permission_gets_noperm_error(acl_server: RedisServer) -> None:
    url = acl_server.user_url("nobody", "nobody-pw")
    with (
        ScoringClient(url, queue="acl-nobody") as client,
        pytest.raises(redis.exceptions.NoPermissionError, match="no permissions"),
    ):
        client.submit([{"tokens": [1, 2, 3], "prompt_len": 1}])


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_passwords_never_reach_logs_or_metrics(
    acl_server: RedisServer, tmp_path: Path, key_prefix: str
) -> None:
    # A worker that authenticates, serves a job and answers /metrics ...
    worker = _worker(acl_server.user_url("worker", WORKER_PASSWORD), key_prefix, tmp_path)
    # ... and one with a wrong password, which logs the refusal.
    wrong = _worker(
        acl_server.user_url("worker", "Wr0ng-Secr3t-xyz"), key_prefix, tmp_path, name="wrong"
    )
    try:
        worker.wait_ready()
        with ScoringClient(
            acl_server.user_url("producer", PRODUCER_PASSWORD), queue=key_prefix
        ) as client:
            client.result(client.submit([{"tokens": [1, 2, 3], "prompt_len": 1}]), timeout=30)
        metrics = urllib.request.urlopen(worker.metrics_url, timeout=5).read().decode()
        assert "scoring_jobs_total" in metrics or "scoring_" in metrics
        # A refused password is retried with backoff (readiness stays false), one line each.
        wrong.wait_log(r"WARNING .*invalid username-password pair", 30)
        assert "Traceback" not in wrong.log()
        worker.signal(signal.SIGTERM)
        worker.wait_exit(30)
        texts = {"worker log": worker.log(), "wrong-password log": wrong.log(), "metrics": metrics}
        assert "redis://worker:***@" in texts["worker log"]  # the redacted URL is logged
        for where, text in texts.items():
            for secret in (WORKER_PASSWORD, "Wr0ng-Secr3t-xyz", ADMIN_PASSWORD):
                assert secret not in text, f"{secret!r} leaked into the {where}"
    finally:
        worker.stop()
        wrong.stop()


def _non_loopback_ip() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_metrics_bind_to_loopback_unless_told_otherwise(
    acl_server: RedisServer, tmp_path: Path, key_prefix: str
) -> None:
    url = acl_server.user_url("worker", WORKER_PASSWORD)
    default = _worker(url, key_prefix, tmp_path, name="default")
    told = _worker(url, key_prefix, tmp_path, "--metrics-host", "0.0.0.0", name="told")
    try:
        m = re.match(r"http://([\d.]+):(\d+)/metrics", default.metrics_url)
        assert m and m.group(1) == "127.0.0.1"
        port = int(m.group(2))
        assert urllib.request.urlopen(default.metrics_url, timeout=5).status == 200
        told_port = int(told.metrics_url.rsplit(":", 1)[1].split("/")[0])
        ip = _non_loopback_ip()
        if ip is None:
            pytest.skip("no non-loopback address to probe from")
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=3)
        assert urllib.request.urlopen(f"http://{ip}:{told_port}/metrics", timeout=5).status == 200
    finally:
        default.stop()
        told.stop()
