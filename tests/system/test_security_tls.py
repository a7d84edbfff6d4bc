"""TLS against a real redis-server started by the test with ``--tls-port`` (``--port 0``): a CA,
server and client certificates made with ``openssl``; ``rediss://`` through
``worker.connections.connect``, and a worker + producer end to end over TLS."""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.faults.servers import RedisServer, have_redis_server
from tests.support.daemon import WorkerProc
from worker.client import ScoringClient
from worker.config import RedisSettings
from worker.connections import connect

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(
        not have_redis_server() or shutil.which("openssl") is None,
        reason="needs redis-server and openssl",
    ),
]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(d: Path) -> dict[str, str]:
    """A throwaway CA, a server cert for 127.0.0.1/localhost and a client cert."""
    _openssl("genrsa", "-out", "ca.key", "2048", cwd=d)
    _openssl(
        "req", "-x509", "-new", "-nodes", "-key", "ca.key", "-sha256", "-days", "2",
        "-subj", "/CN=scoring-test-ca", "-out", "ca.crt", cwd=d,
    )  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, cn in (("server", "localhost"), ("client", "scoring-worker")):
        _openssl("genrsa", "-out", f"{name}.key", "2048", cwd=d)
        _openssl(
            "req", "-new", "-key", f"{name}.key", "-subj", f"/CN={cn}", "-out", f"{name}.csr",
            cwd=d,
        )  # fmt: skip
        ext = ["-extfile", "san.ext"] if name == "server" else []
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-sha256", *ext, cwd=d,
        )  # fmt: skip
    return {
        "ca": str(d / "ca.crt"),
        "cert": str(d / "server.crt"),
        "key": str(d / "server.key"),
        "client_cert": str(d / "client.crt"),
        "client_key": str(d / "client.key"),
    }


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_server(
    certs: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisServer]:
    """redis-server with TLS only, client certificates required (``--tls-auth-clients yes``)."""
    server = RedisServer(tmp_path_factory.mktemp("tls-redis"), tls={**certs, "auth_clients": "yes"})
    try:
        server.start()
    except RuntimeError as exc:  # a build without TLS support
        pytest.skip(f"redis-server has no TLS: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tls_optional_server(
    certs: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisServer]:
    """redis-server with TLS where client certificates are optional."""
    server = RedisServer(
        tmp_path_factory.mktemp("tls-opt-redis"), tls={**certs, "auth_clients": "optional"}
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _settings(server: RedisServer, certs: dict[str, str], **over: object) -> RedisSettings:
    kwargs: dict[str, object] = {
        "url": server.url,
        "ssl_ca_certs": certs["ca"],
        "ssl_certfile": certs["client_cert"],
        "ssl_keyfile": certs["client_key"],
        "connect_timeout_s": 3.0,
        "socket_timeout_s": 3.0,
    }
    kwargs.update(over)
    return RedisSettings(**kwargs)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_connect_rediss_with_ca_and_client_cert(
    tls_server: RedisServer, certs: dict[str, str]
) -> None:
    assert tls_server.url.startswith("rediss://")
    client = connect(_settings(tls_server, certs))
    assert client.ping()
    client.xadd("scoring:{tls}:jobs", {"payload": b"x"})
    assert client.xlen("scoring:{tls}:jobs") == 1
    client.delete("scoring:{tls}:jobs")


@pytest.mark.timeout(60)
def test_tls_refuses_missing_client_cert_and_unknown_ca(
    tls_server: RedisServer, certs: dict[str, str], tmp_path: Path
) -> None:
    no_cert = connect(_settings(tls_server, certs, ssl_certfile=None, ssl_keyfile=None))
    with pytest.raises(redis.ConnectionError):
        no_cert.ping()
    other = make_certs(tmp_path)  # a different CA: the server's cert does not verify
    wrong_ca = connect(_settings(tls_server, certs, ssl_ca_certs=other["ca"]))
    with pytest.raises(redis.ConnectionError, match=r"(?i)certificate"):
        wrong_ca.ping()
    plain = redis.Redis(host="127.0.0.1", port=tls_server.port, socket_timeout=3)
    with pytest.raises(redis.ConnectionError):
        plain.ping()  # a plaintext client cannot talk to the TLS port


@pytest.mark.timeout(60)
def test_tls_optional_client_auth_accepts_server_verification_only(
    tls_optional_server: RedisServer, certs: dict[str, str]
) -> None:
    client = connect(_settings(tls_optional_server, certs, ssl_certfile=None, ssl_keyfile=None))
    assert client.ping()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_worker_and_client_end_to_end_over_tls(
    tls_server: RedisServer, certs: dict[str, str], tmp_path: Path, key_prefix: str
) -> None:
    env = {
        "SCORING_REDIS_URL": tls_server.url,
        "SCORING_SSL_CA_CERTS": certs["ca"],
        "SCORING_SSL_CERTFILE": certs["client_cert"],
        "SCORING_SSL_KEYFILE": certs["client_key"],
    }
    worker = WorkerProc(
        ["--queue", key_prefix, "--scorer", "noop", "--metrics-port", "-1", "--block-ms", "200"],
        tmp_path / "w.log",
        env=env,
    )
    try:
        worker.wait_ready()
        assert "rediss://127.0.0.1" in worker.log()
        with ScoringClient(
            tls_server.url,
            queue=key_prefix,
            ssl_ca_certs=certs["ca"],
            ssl_certfile=certs["client_cert"],
            ssl_keyfile=certs["client_key"],
        ) as client:
            results = list(
                client.score_many(
                    [[{"tokens": [1, 2, 3, i], "prompt_len": 2}] for i in range(20)], timeout=30
                )
            )
        assert [len(r.seqs[0].logps) for r in results] == [2] * 20
        worker.signal(signal.SIGTERM)
        assert worker.wait_exit(30) == 0
    finally:
        worker.stop()
