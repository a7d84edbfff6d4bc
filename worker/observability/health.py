"""Liveness/readiness state and the HTTP endpoint (``/metrics``, ``/healthz``, ``/readyz``,
``/startupz``).

The endpoint opens before the model loads. ``/startupz`` answers 503 until the model is loaded and
200 from then on (a startup probe on it gives a hung load a deadline); ``/healthz`` answers 200
while the consumer loop and the lease thread have made progress recently (a wedged loop makes the
orchestrator restart the pod), and always while the model loads; ``/readyz`` answers 200 while the
model is loaded and warmed, Redis is reachable and the worker is not draining.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)


class HealthState:
    """Thread-safe flags and heartbeats read by ``/healthz``, ``/readyz`` and ``/startupz``.

    ``WorkerMetrics.bind_health`` derives the ``scoring_worker_ready`` and
    ``scoring_model_loaded`` gauges from the same flags, so the metrics and the probes agree.
    """

    def __init__(self, *, stall_after_s: float = 120.0, clock: Any = time.monotonic) -> None:
        self.stall_after_s = stall_after_s
        self._clock = clock
        self._lock = threading.Lock()
        now = clock()
        self._beats: dict[str, float] = {"loop": now, "lease": now}
        self.model_ready = False
        self.redis_ok = False
        self.draining = False
        self.started = False
        #: What Redis keeps (``worker.connections.server_summary``), shown beside readiness.
        self.redis_server: dict[str, Any] = {}

    def beat(self, name: str) -> None:
        """Record progress of a component (``loop`` or ``lease``)."""
        with self._lock:
            self._beats[name] = self._clock()

    def busy_beat(self, name: str) -> None:
        """Alias of :meth:`beat` for long operations that report progress."""
        self.beat(name)

    def liveness(self) -> tuple[bool, dict[str, Any]]:
        """(alive, details): alive while every heartbeat is younger than ``stall_after_s``."""
        now = self._clock()
        with self._lock:
            ages = {k: round(now - v, 3) for k, v in self._beats.items()}
        # Before the loop starts (model loading) nothing can stall: loading is not a hang.
        stalled = [k for k, age in ages.items() if self.started and age > self.stall_after_s]
        return not stalled, {"heartbeat_age_s": ages, "stalled": stalled}

    def startup(self) -> tuple[bool, dict[str, Any]]:
        """(started up, details): true once the model is loaded, and from then on.

        Redis and draining do not matter here: a startup probe only bounds the model load.
        """
        return bool(self.model_ready), {"model_ready": self.model_ready}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(ready, details): model loaded, Redis reachable, started and not draining."""
        details = {
            "model_ready": self.model_ready,
            "redis_ok": self.redis_ok,
            "draining": self.draining,
            "started": self.started,
            "redis_server": self.redis_server,
        }
        ok = self.model_ready and self.redis_ok and self.started and not self.draining
        return ok, details


def _handler(registry: CollectorRegistry, state: HealthState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body = generate_latest(registry)
                self._send(200, body, CONTENT_TYPE_LATEST)
            elif path in ("/healthz", "/livez"):
                ok, details = state.liveness()
                self._send_json(200 if ok else 503, {"ok": ok, **details})
            elif path == "/readyz":
                ok, details = state.readiness()
                self._send_json(200 if ok else 503, {"ok": ok, **details})
            elif path == "/startupz":
                ok, details = state.startup()
                self._send_json(200 if ok else 503, {"ok": ok, **details})
            else:
                self._send(404, b"not found\n", "text/plain")

        def _send_json(self, code: int, obj: dict[str, Any]) -> None:
            self._send(code, json.dumps(obj).encode() + b"\n", "application/json")

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("http: " + fmt, *args)

    return Handler


class HealthServer:
    """The HTTP endpoint in a daemon thread. ``port=0`` picks a free port (see ``.port``)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        state: HealthState,
        *,
        host: str = "127.0.0.1",
        port: int = 9400,
    ) -> None:
        self._server = ThreadingHTTPServer((host, port), _handler(registry, state))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="health-http", daemon=True
        )

    @property
    def host(self) -> str:
        """The bound address."""
        return str(self._server.server_address[0])

    @property
    def port(self) -> int:
        """The bound port."""
        return int(self._server.server_address[1])

    def start(self) -> HealthServer:
        """Start serving; returns self."""
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics (and /healthz, /readyz)", self.host, self.port)
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()
