"""A real ``redis-server`` process per test: free port, own data dir, AOF/TLS/ACL options,
kill -9 and restart on the same data. Used by the fault harness and the security tests.

Plain classes (not fixtures) so ``tests/conftest.py`` stays the only conftest.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

from worker.processes.local import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def have_redis_server() -> bool:
    """True when a ``redis-server`` binary is installed."""
    return os.path.exists(REDIS_SERVER)


class RedisServer:
    """One ``redis-server`` on ``127.0.0.1:<free port>`` with its data in ``workdir``.

    ``args`` are extra server options (``["--appendonly", "yes"]``). With ``tls`` (a dict of
    ``cert``, ``key``, ``ca`` paths and optional ``auth_clients``) it listens on a TLS port only.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        args: list[str] | None = None,
        tls: dict[str, str] | None = None,
        password: str | None = None,
        port: int | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.args = list(args or [])
        self.tls = tls
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / "redis.log"

    @property
    def url(self) -> str:
        """``redis://`` (or ``rediss://``) URL of the default user."""
        scheme = "rediss" if self.tls else "redis"
        auth = f":{self.password}@" if self.password else ""
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0"

    def user_url(self, user: str, password: str) -> str:
        """URL of an ACL user."""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{user}:{password}@127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        """The server's command line."""
        cmd = [
            REDIS_SERVER,
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--logfile", str(self.log_path),
            "--save", "",
            "--daemonize", "no",
            "--protected-mode", "no",
        ]  # fmt: skip
        if self.tls:
            cmd += [
                "--port", "0",
                "--tls-port", str(self.port),
                "--tls-cert-file", self.tls["cert"],
                "--tls-key-file", self.tls["key"],
                "--tls-ca-cert-file", self.tls["ca"],
                "--tls-auth-clients", self.tls.get("auth_clients", "yes"),
            ]  # fmt: skip
        else:
            cmd += ["--port", str(self.port)]
        if self.password:
            cmd += ["--requirepass", self.password]
        return cmd + self.args

    def admin(self) -> redis.Redis:
        """A client for the default user (TLS with the harness's client cert when set)."""
        kwargs: dict[str, Any] = {"socket_timeout": 10, "socket_connect_timeout": 5}
        if self.tls:
            kwargs.update(
                ssl_ca_certs=self.tls["ca"],
                ssl_certfile=self.tls.get("client_cert"),
                ssl_keyfile=self.tls.get("client_key"),
            )
        return redis.Redis.from_url(self.url, **kwargs)

    def start(self, timeout: float = 20.0) -> RedisServer:
        """Start the server and wait until it answers PING (and has loaded its AOF)."""
        self.proc = subprocess.Popen(
            self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.log_tail()}")
            try:
                client = self.admin()
                if client.ping() and client.info("persistence").get("loading", 0) == 0:
                    client.close()
                    return self
            except redis.RedisError as exc:
                last = exc
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer: {last}; {self.log_tail()}")

    def log_tail(self, n: int = 20) -> str:
        """The last lines of the server log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` and wait for the process to exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def restart(self, sig: int = signal.SIGKILL, down_s: float = 0.0) -> None:
        """Kill (default ``kill -9``) and start again on the same port and data dir."""
        self.kill(sig)
        if down_s:
            time.sleep(down_s)
        self.start()

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL)."""
        self.kill(signal.SIGTERM)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
