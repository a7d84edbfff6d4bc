"""``scoring-worker gateway``: the HTTP gateway in front of a queue (``worker.gateway``).

A producer: it imports the client side only, never torch. Every flag has its ``SCORING_*``
variable (the flag wins) and its default in ``--help``. Start-up problems (a bad setting, the
gateway extra not installed, Redis out of reach, the port taken) are one ``error: ...`` line on
stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from typing import Any

from worker.commands._options import add_queue_args, add_redis_args, redis_settings
from worker.config import env_get

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def _env(name: str, default: object) -> str | None:
    value = env_get(name)
    return value if value is not None else (None if default is None else str(default))


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the gateway flags."""
    add_redis_args(parser)
    add_queue_args(parser, group=False)
    g = parser.add_argument_group("gateway")

    def flag(name: str, env: str, default: object, help_text: str, **kw: Any) -> None:
        g.add_argument(
            name,
            default=_env(env, default),
            help=f"{help_text} (env SCORING_{env}; default {default})",
            **kw,
        )

    flag(
        "--host",
        "GATEWAY_HOST",
        DEFAULT_HOST,
        "address to listen on (loopback by default; 0.0.0.0 for every interface, then set "
        "--api-key)",
    )
    flag("--port", "GATEWAY_PORT", DEFAULT_PORT, "TCP port to listen on", type=int)
    flag(
        "--api-key",
        "GATEWAY_API_KEY",
        None,
        "require the key on every route but /health: Authorization: Bearer <key>, HTTP Basic "
        "with the key as password (http://k:<key>@host/...), or X-API-Key: <key> (Tinker SDK "
        "clients send only keys that start with tml-)",
    )
    flag(
        "--model-name",
        "GATEWAY_MODEL_NAME",
        None,
        "the model name /v1/models lists and requests' model may carry for the base weights "
        "(unset: the model the live workers report); any other model names an adapter",
    )
    flag(
        "--timeout-s",
        "GATEWAY_TIMEOUT_S",
        100.0,
        "seconds a request waits for its scores before a 504 (also the job's deadline)",
        type=float,
    )
    flag(
        "--window-ms",
        "GATEWAY_WINDOW_MS",
        5.0,
        "milliseconds a batch of concurrent requests stays open before it is submitted as one job",
        type=float,
    )
    flag(
        "--max-batch-seqs",
        "GATEWAY_MAX_BATCH_SEQS",
        256,
        "sequences per coalesced job at most",
        type=int,
    )
    flag(
        "--max-batch-tokens",
        "GATEWAY_MAX_BATCH_TOKENS",
        1 << 20,
        "tokens per coalesced job at most",
        type=int,
    )
    flag(
        "--max-body-bytes",
        "GATEWAY_MAX_BODY_BYTES",
        64 * 1024 * 1024,
        "request bodies above this get 413",
        type=int,
    )
    flag(
        "--max-concurrent",
        "GATEWAY_MAX_CONCURRENT",
        8192,
        "requests in flight at most; more get 503",
        type=int,
    )
    flag(
        "--resubmit-after-s",
        "GATEWAY_RESUBMIT_AFTER_S",
        30.0,
        "add a job again (same id) when its result is this overdue, across a Redis failover; "
        "0 turns it off",
        type=float,
    )
    flag(
        "--allow-unknown-queue",
        "GATEWAY_ALLOW_UNKNOWN_QUEUE",
        False,
        "requests to a queue no worker ever served (no consumer group) wait for one too, for a "
        "fleet that creates its group on first start (default: 503 unknown_queue at once; a "
        "queue with a group always waits)",
        action="store_true",
    )
    flag(
        "--no-worker-check",
        "GATEWAY_NO_WORKER_CHECK",
        False,
        "ask Redis nothing about the queue: every request waits, /health says nothing of the "
        "queue (a producer ACL without ZCOUNT / XINFO GROUPS)",
        action="store_true",
    )
    flag(
        "--tinker-max-pending",
        "GATEWAY_TINKER_MAX_PENDING",
        4096,
        "Tinker samples submitted and not yet retrieved, at most; more get 429 (the SDK backs off)",
        type=int,
    )
    flag(
        "--tinker-result-ttl-s",
        "GATEWAY_TINKER_RESULT_TTL_S",
        600.0,
        "seconds a Tinker sample's answer waits to be retrieved before it is dropped",
        type=float,
    )
    flag(
        "--image-token-id",
        "GATEWAY_IMAGE_TOKEN_ID",
        None,
        "the served vision-language model's image token id (config.json's image_token_id): "
        "a Tinker image chunk becomes expected_tokens copies of it (None: image chunks refused)",
        type=int,
    )
    flag(
        "--allow-redis-eviction",
        "ALLOW_REDIS_EVICTION",
        False,
        "serve even when Redis's maxmemory-policy is not noeviction (it may then delete jobs "
        "and results under memory pressure); logged, and 1 in scoring_redis_evicting",
        action="store_true",
    )
    flag(
        "--redis-check-interval-s",
        "REDIS_CHECK_INTERVAL_S",
        60.0,
        "seconds between reads of Redis's eviction policy, persistence and memory",
        type=float,
    )
    flag(
        "--server-log-level",
        "GATEWAY_SERVER_LOG_LEVEL",
        "warning",
        "log level of the HTTP server's own logger (uvicorn)",
    )


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT."""
    try:
        import uvicorn

        from worker.client.aio import AsyncScoringClient
        from worker.gateway.app import create_app
        from worker.gateway.config import GatewayConfig
    except ImportError as exc:
        return _fail(
            f"the gateway needs its extra ({exc.name} is missing): "
            "pip install 'scoring-worker[gateway]'"
        )
    try:
        resubmit = float(args.resubmit_after_s)
        config = GatewayConfig(
            api_key=args.api_key or None,
            model_name=args.model_name or None,
            timeout_s=float(args.timeout_s),
            window_ms=float(args.window_ms),
            max_batch_seqs=int(args.max_batch_seqs),
            max_batch_tokens=int(args.max_batch_tokens),
            max_body_bytes=int(args.max_body_bytes),
            max_concurrent=int(args.max_concurrent),
            resubmit_after_s=resubmit if resubmit > 0 else None,
            check_queue=not _truthy(args.no_worker_check),
            allow_unknown_queue=_truthy(args.allow_unknown_queue),
            tinker_max_pending=int(args.tinker_max_pending),
            tinker_result_ttl_s=float(args.tinker_result_ttl_s),
            image_token_id=None if args.image_token_id is None else int(args.image_token_id),
            allow_redis_eviction=_truthy(args.allow_redis_eviction),
            redis_check_interval_s=float(args.redis_check_interval_s),
        )
        settings = redis_settings(args, client_name="scoring-gateway")
        port = int(args.port)
    except (TypeError, ValueError) as exc:
        return _fail(f"bad gateway setting: {exc}")
    problem = _check_redis(settings, config.allow_redis_eviction)
    if problem:
        return _fail(problem)
    try:
        sock = socket.create_server((args.host, port), reuse_port=False)
    except OSError as exc:
        return _fail(f"cannot listen on {args.host}:{port}: {exc.strerror or exc}")
    if config.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without --api-key: anyone who reaches it can score", args.host)

    def client() -> AsyncScoringClient:
        return AsyncScoringClient.from_settings(
            settings,
            queue=args.queue,
            partitions=args.partitions,
            resubmit_after_s=config.resubmit_after_s,
            wait_for_unknown_queue=True,  # the gateway applies the queue rule per request
        )

    app = create_app(config, client)
    log.info(
        "gateway for queue %r on http://%s:%d (api key %s)",
        args.queue,
        args.host,
        port,
        "required" if config.api_key else "off",
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level=str(args.server_log_level).lower(),
            log_config=None,
            access_log=False,
            lifespan="on",
        )
    )
    server.run(sockets=[sock])
    return 0


def _truthy(value: object) -> bool:
    return value is True or str(value).strip().lower() in ("1", "true", "yes", "on")


def _check_redis(settings: object, allow_eviction: bool) -> str | None:
    """None when Redis answers ``PING`` and keeps what it is given (``check_server``: an
    evicting policy is refused unless ``allow_eviction``), else the one-line reason."""
    from worker.connections import check_server, connect
    from worker.errors import ConfigError

    try:
        client = connect(settings)  # type: ignore[arg-type]
        client.ping()
    except Exception as exc:  # any connection or auth error is a start-up error here
        url = getattr(settings, "url", "?")
        return f"cannot reach Redis at {url}: {exc}"
    try:
        check_server(client, allow_eviction=allow_eviction)
    except ConfigError as exc:
        return str(exc)
    finally:
        client.close()
    return None
