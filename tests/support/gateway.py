"""The gateway served in a background thread (real uvicorn on a loopback port), for tests that
talk to it with real HTTP clients (``requests``, TRL's ``VLLMClient``). Plain classes, no
fixtures."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from worker.client.aio import AsyncScoringClient
from worker.gateway.app import create_app
from worker.gateway.config import GatewayConfig


class GatewayThread:
    """``create_app`` over ``queue`` on ``redis_url``, served on 127.0.0.1:<free port>."""

    def __init__(self, redis_url: str, queue: str, **config: Any) -> None:
        self.config = GatewayConfig(**config)
        self.app = create_app(
            self.config,
            lambda: AsyncScoringClient(redis_url, queue=queue, wait_for_unknown_queue=True),
        )
        self.core = self.app.core  # type: ignore[attr-defined]
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(self.app, log_level="warning", log_config=None, lifespan="on")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def __enter__(self) -> GatewayThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the gateway did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self._sock.close()
