"""The Tinker API's futures: a job per ``asample``, its answer kept until it is retrieved or
expires (``FutureStore``).

The SDK's protocol (``tinker/lib/api_future_impl.py``, ``_APIFuture``): ``asample`` returns a
request id at once; the SDK then long-polls ``retrieve_future`` with it until it gets the result
(protobuf), an ``{"error", "category"}`` body (raised as ``RequestFailedError``, no retry) or
``{"type": "try_again"}`` (poll again); a poll it abandons is posted to ``cancel_future``. A 410
on ``retrieve_future`` makes the SDK submit the sample again (its ``RetryableException``): the
answer to an id this gateway does not hold (expired, or the gateway restarted). A 429 on
``asample`` makes it back off and resend.

Bounds: at most ``max_pending`` futures not yet retrieved (running or answered), more are a 429
``rate_limited``; an answer not retrieved within ``ttl_s`` of its completion is dropped; a
retrieved one is kept ``RETRIEVED_GRACE_S`` for a retry of the same retrieval. A request id is
the caller's ``(sampling_session_id, seq_id)``: the same pair again (a resent ``asample``) gets
the same future, never a second job.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from worker.gateway.errors import GatewayError, error_code, error_message

log = logging.getLogger(__name__)

#: How long an answer stays after it was retrieved (a lost response's retrieval is retried).
RETRIEVED_GRACE_S = 30.0
#: Error codes that are the caller's error (``category: user``); every other is ``server``.
USER_CODES = frozenset(
    {
        "bad_request",
        "unsupported_mode",
        "too_long",
        "too_large",
        "model_not_found",
        "payload_too_large",
    }
)


@dataclass(frozen=True)
class Outcome:
    """A finished future: protobuf bytes, or an error message and its category."""

    body: bytes | None = None
    error: str | None = None
    category: str = "server"


@dataclass
class _Future:
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None
    expires: float = math.inf  # monotonic; set when the answer arrives
    retrieved: bool = False
    task: asyncio.Task[None] | None = None


def outcome_of(exc: BaseException) -> Outcome:
    """The error outcome of whatever a job raised."""
    code = error_code(exc)
    if code == "internal":
        log.error("tinker sample failed: %s", exc, exc_info=exc)
    category = "user" if code in USER_CODES else "server"
    return Outcome(error=f"[{code}] {error_message(exc)}", category=category)


class FutureStore:
    """The futures of one gateway (see the module docstring); made and used in its loop."""

    def __init__(self, max_pending: int, ttl_s: float) -> None:
        self.max_pending = max_pending
        self.ttl_s = ttl_s
        self._futures: dict[str, _Future] = {}
        self._swept = time.monotonic()
        self.pending = 0  # futures not yet retrieved (running or answered)

    def __len__(self) -> int:
        return len(self._futures)

    def submit(self, request_id: str, run: Callable[[], Awaitable[bytes]]) -> bool:
        """Start ``run`` as the future ``request_id`` unless that future exists (False: it
        did, nothing started). 429 ``rate_limited`` at ``max_pending``."""
        self._sweep()
        if request_id in self._futures:
            return False
        if self.pending >= self.max_pending:
            raise GatewayError(
                "rate_limited", f"{self.pending} samples pending (limit {self.max_pending})"
            )
        future = self._futures[request_id] = _Future()
        self.pending += 1
        future.task = asyncio.get_running_loop().create_task(self._run(future, run))
        return True

    def answer(self, request_id: str, outcome: Outcome) -> None:
        """Store an answer known at once (a request refused before any job), unless the
        future exists."""
        self._sweep()
        if request_id not in self._futures:
            self.pending += 1
            self._finish(self._futures.setdefault(request_id, _Future()), outcome)

    async def wait(self, request_id: str, timeout_s: float) -> Outcome | None:
        """The outcome of ``request_id`` within ``timeout_s`` (None: still running); 410
        ``result_gone`` for an id not held."""
        self._sweep()
        future = self._futures.get(request_id)
        if future is None:
            raise GatewayError(
                "result_gone",
                f"no sample {request_id!r} here (expired after {self.ttl_s:g} s, or the gateway "
                "restarted): submit it again",
            )
        if not future.done.is_set():
            try:
                await asyncio.wait_for(future.done.wait(), timeout_s)
            except TimeoutError:
                return None
        if not future.retrieved:
            future.retrieved = True
            self.pending -= 1
            future.expires = min(future.expires, time.monotonic() + RETRIEVED_GRACE_S)
        return future.outcome

    def cancel(self, request_id: str) -> bool:
        """Drop a future the caller abandoned (its job, if still running, is not waited for);
        False when it is not held."""
        future = self._futures.pop(request_id, None)
        if future is None:
            return False
        if not future.retrieved:
            self.pending -= 1
        if future.task is not None:
            future.task.cancel()
        return True

    async def close(self) -> None:
        """Cancel what is still running."""
        tasks = [f.task for f in self._futures.values() if f.task and not f.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._futures.clear()
        self.pending = 0

    async def _run(self, future: _Future, run: Callable[[], Awaitable[bytes]]) -> None:
        try:
            outcome = Outcome(body=await run())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # every error becomes the future's error result
            outcome = outcome_of(exc)
        self._finish(future, outcome)

    def _finish(self, future: _Future, outcome: Outcome) -> None:
        future.outcome = outcome
        future.expires = time.monotonic() + self.ttl_s
        future.task = None
        future.done.set()

    def _sweep(self) -> None:
        """Drop expired answers (at most once a second)."""
        now = time.monotonic()
        if now - self._swept < 1.0:
            return
        self._swept = now
        for request_id in [r for r, f in self._futures.items() if f.expires <= now]:
            if not self._futures.pop(request_id).retrieved:
                self.pending -= 1
