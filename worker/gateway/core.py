"""The one place requests become jobs: ``GatewayCore`` owns the asyncio client and its
``Coalescer``, applies the queue rule to each request, knows what the served model is called and
which weights a request's ``model`` names. Every peer format's route calls ``score``.

The queue rule (``worker.client.workers``), per request: a queue with a live worker or a
consumer group takes the request, which waits for a worker within ``timeout_s`` (scale from zero:
the queued job is the lag the autoscaler starts a worker on); a queue with neither is answered
503 ``unknown_queue`` at once, naming the queues there are, unless ``allow_unknown_queue``.

Redis commands of its own (read only), each answer reused for ``worker_check_s``:
``ZRANGEBYSCORE scoring:{q}:workers <now> +inf LIMIT 0 1`` (a live worker's heartbeat,
``worker.streams.heartbeat``) and ``HGET scoring:{q}:worker:<c> model`` (the model it serves),
then the client's ``ZCOUNT`` and, while no worker is live, ``XINFO GROUPS`` (the queue's
state); ``SCAN`` for the queues a refusal names; ``PING`` for health. What Redis keeps (its
eviction policy, persistence and memory: ``worker.connections.ServerWatch``) is read at start,
where a policy other than ``noeviction`` fails the start unless ``allow_redis_eviction``, and
every ``redis_check_interval_s`` after, on a connection of its own in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from worker import connections, keys
from worker.client.aio import AsyncScoringClient
from worker.client.coalesce import BatchKey, Coalescer
from worker.client.errors import UnknownQueueError
from worker.client.results import SeqScore
from worker.client.workers import QueueState
from worker.connections import ServerState, ServerWatch
from worker.errors import ConfigError
from worker.gateway.config import GatewayConfig
from worker.gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

#: What ``/v1/models`` lists when neither ``--model-name`` nor a live worker names the model.
FALLBACK_MODEL = "scoring-worker"
ADAPTER_PREFIX = "adapter:"
VERSION_PREFIX = "version:"


class GatewayCore:
    """Requests in, jobs out (see the module docstring). ``start`` inside the event loop."""

    def __init__(
        self,
        config: GatewayConfig,
        client_factory: Callable[[], AsyncScoringClient],
        metrics: GatewayMetrics,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self._factory = client_factory
        self.client: AsyncScoringClient | None = None
        self.coalescer: Coalescer | None = None
        # (checked at, a live consumer, the queue's state)
        self._alive: tuple[float, str | None, QueueState] = (-1e9, None, QueueState(None, None))
        self._checking: asyncio.Future[str | None] | None = None  # the one check under way
        self._served: str | None = None  # the model a live worker reported last
        self._refusal: tuple[float, UnknownQueueError] | None = None  # the last, with its time
        self.server_watch = ServerWatch(config.redis_check_interval_s)
        #: What Redis keeps (``worker.connections.server_summary``), shown by ``/health``.
        self.redis_server: dict[str, Any] = {}
        self._server_client: Any = None  # a sync client, used from a thread
        self._server_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Create the client and the coalescer (in the running loop); warn when the queue is
        unknown (no worker serves it, none ever did)."""
        self.client = self._factory()
        self.coalescer = Coalescer(
            self.client,
            window_s=self.config.window_ms / 1000.0,
            max_seqs=self.config.max_batch_seqs,
            max_tokens=self.config.max_batch_tokens,
            on_job=self.metrics.jobs.inc,
        )
        await self._check_server()
        self._server_task = asyncio.create_task(self._watch_server())
        if not self.config.check_queue:
            return
        try:
            state = await self.queue_state()
        except Exception as exc:  # Redis away at start: requests will say so
            log.warning("cannot ask Redis about queue %r: %s", self.queue, exc)
            return
        if state.known is False:
            queues = await self.client.list_queues()
            log.warning(
                "queue %r is unknown: no worker serves it and none ever did (no consumer group); "
                "%s until a worker starts on it (queues there: %s)%s",
                self.queue,
                "requests wait"
                if self.config.allow_unknown_queue
                else "requests are refused (503 unknown_queue)",
                ", ".join(queues or []) or "none listed",
                "" if self.config.allow_unknown_queue else "; --allow-unknown-queue waits instead",
            )
        elif state.live == 0:
            log.info("no worker serves queue %r yet: requests wait for one", self.queue)

    async def _check_server(self) -> None:
        """The start-up read of what Redis keeps: ``ConfigError`` when a primary evicts and
        ``allow_redis_eviction`` is off (``scoring-worker gateway`` says so before, in one line)."""
        try:
            states = await asyncio.to_thread(self._read_server)
        except connections.CONNECT_ERRORS as exc:  # Redis away at start: requests will say so
            log.warning("cannot read Redis's eviction policy: %s", exc)
            return
        problem = connections.eviction_problem(states)
        if problem and not self.config.allow_redis_eviction:
            raise ConfigError(problem)
        self._publish(states)

    async def _watch_server(self) -> None:
        """Read the server again every ``redis_check_interval_s`` (a policy changed while
        serving is logged by the watch and turns ``scoring_redis_evicting`` on)."""
        while True:
            await asyncio.sleep(self.config.redis_check_interval_s)
            try:
                self._publish(await asyncio.to_thread(self._read_server))
            except Exception as exc:  # Redis away: the next round tries again
                log.warning("cannot read Redis's eviction policy: %s", exc)

    def _read_server(self) -> list[ServerState]:
        if self._server_client is None:
            assert self.client is not None
            self._server_client = connections.connect(self.client.settings)
        return self.server_watch.read(self._server_client)

    def _publish(self, states: list[ServerState]) -> None:
        allowed = self.config.allow_redis_eviction
        summary = connections.server_summary(states, allowed=allowed)
        self.metrics.set_redis_server(
            evicting=summary["evicting"],
            allowed=allowed,
            persistent=summary["persistent"],
            memory_used_ratio={
                (s.node, str(s.memory_limit)): ratio
                for s in states
                if (ratio := s.memory_used_ratio) is not None
            },
        )
        self.redis_server = summary

    async def close(self) -> None:
        """Answer what is in flight, then close the client (its reply stream goes)."""
        if self._server_task is not None:
            self._server_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._server_task
        if self._server_client is not None:
            self._server_client.close()
        if self.coalescer is not None:
            await self.coalescer.close()
        if self.client is not None:
            await self.client.close()

    @property
    def queue(self) -> str:
        """The queue this gateway feeds."""
        assert self.client is not None
        return self.client.queue

    # -- scoring

    async def score(
        self, route: str, seqs: Sequence[Any], key: BatchKey, images: Any = None
    ) -> list[SeqScore]:
        """The scores of ``seqs`` (sequence maps as ``ScoringClient.score`` takes them), in
        order, coalesced with concurrent requests of the same ``key``; ``images``: the encoded
        files their ``images`` indices name (sent once per job). Raises
        ``UnknownQueueError`` (the queue rule), ``BadRequest`` / ``JobFailed`` (their ``code``)
        or ``ScoringTimeout``."""
        assert self.coalescer is not None, "GatewayCore.start was not awaited"
        if not seqs:
            return []
        await self.admit()
        self.metrics.sequences.labels(route=route).inc(len(seqs))
        return await self.coalescer.score(list(seqs), key, self.config.timeout_s, images=images)

    async def admit(self) -> None:
        """The queue rule: raise ``UnknownQueueError`` when no worker serves the queue and none
        ever did (the refusal, with the queues it names, reused for ``worker_check_s``); never
        with ``check_queue`` off or ``allow_unknown_queue`` on."""
        if not self.config.check_queue or self.config.allow_unknown_queue:
            return
        if (await self.queue_state()).known is not False:
            return
        now = time.monotonic()
        if self._refusal is None or now - self._refusal[0] >= self.config.worker_check_s:
            assert self.client is not None
            self._refusal = (now, UnknownQueueError(self.queue, await self.client.list_queues()))
        raise self._refusal[1]

    async def queue_state(self) -> QueueState:
        """The queue's state (live workers, a consumer group), reused for ``worker_check_s``."""
        await self.live_worker()
        return self._alive[2]

    async def live_worker(self) -> str | None:
        """A consumer whose heartbeat has not expired (None: no worker serves the queue); one
        check at a time, its answer reused for ``worker_check_s``."""
        checked, consumer, _ = self._alive
        if time.monotonic() - checked < self.config.worker_check_s:
            return consumer
        if self._checking is not None:  # another request is asking Redis: share its answer
            return await asyncio.shield(self._checking)
        self._checking = asyncio.get_running_loop().create_future()
        try:
            consumer = await self._find_worker()
        except BaseException as exc:
            self._checking.set_exception(exc)
            self._checking.exception()  # retrieved: the waiters (if any) re-raise it
            raise
        else:
            self._checking.set_result(consumer)
        finally:
            self._checking = None
        return consumer

    async def _find_worker(self) -> str | None:
        """One live consumer (and the model it serves, for ``model_name``) and the queue's
        state."""
        now = time.monotonic()
        assert self.client is not None
        redis = self.client.redis
        found = await redis.zrangebyscore(
            keys.workers_index(self.queue), time.time(), "+inf", start=0, num=1
        )
        consumer = _text(found[0]) if found else None
        if consumer is not None:
            model = await redis.hget(keys.worker_heartbeat(self.queue, consumer), "model")
            if model:
                self._served = _text(model)
        state = (
            await self.client.queue_state() if self.config.check_queue else QueueState(None, None)
        )
        self._alive = (now, consumer, state)
        return consumer

    async def ping(self) -> bool:
        """Whether Redis answers."""
        assert self.client is not None
        try:
            return bool(await self.client.redis.ping())
        except Exception as exc:  # any Redis or connection error: not healthy
            log.warning("health: Redis does not answer: %s", exc)
            return False

    # -- models and weights

    async def model_name(self) -> str:
        """The served model's name: ``--model-name``, else what a live worker reports (read
        with the liveness check, so at most one lookup at a time)."""
        if self.config.model_name:
            return self.config.model_name
        await self.live_worker()
        return self._served or FALLBACK_MODEL

    async def weights(self, model: str | None) -> tuple[str | None, str | None]:
        """``(adapter, version)`` a request's ``model`` names: the served name (or none) is the
        base weights; ``adapter:NAME`` / ``version:NAME`` name one explicitly; any other name is
        a LoRA adapter (how vLLM serves adapters under their own model names)."""
        if not model or model == await self.model_name():
            return None, None
        if model.startswith(VERSION_PREFIX):
            return None, model[len(VERSION_PREFIX) :] or None
        if model.startswith(ADAPTER_PREFIX):
            return model[len(ADAPTER_PREFIX) :] or None, None
        return model, None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
