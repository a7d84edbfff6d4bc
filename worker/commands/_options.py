"""Flags shared by the producer/operator commands (``enqueue``, ``info``, ``dlq``, ``check``,
``demo``): Redis connection, TLS, queue, partitions and group, each with a ``SCORING_*`` env
equivalent (a flag on the command line wins)."""

from __future__ import annotations

import argparse

from worker import keys
from worker.config import RedisSettings, env_bool, env_get

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def add_redis_args(parser: argparse.ArgumentParser, *, url_default: str | None = None) -> None:
    """``--redis-url``, ``--cluster`` and the TLS options."""
    g = parser.add_argument_group("redis")
    g.add_argument(
        "--redis-url",
        default=env_get("REDIS_URL", url_default),
        help="redis://, rediss:// (TLS), unix://, redis+cluster:// "
        f"(env SCORING_REDIS_URL; default {url_default or 'see command'})",
    )
    g.add_argument(
        "--cluster",
        action="store_true",
        default=env_bool(env_get("CLUSTER")),
        help="talk Redis Cluster (also implied by redis+cluster://; env SCORING_CLUSTER)",
    )
    g.add_argument("--ssl-ca-certs", default=env_get("SSL_CA_CERTS"), help="CA bundle for TLS")
    g.add_argument("--ssl-certfile", default=env_get("SSL_CERTFILE"), help="client certificate")
    g.add_argument("--ssl-keyfile", default=env_get("SSL_KEYFILE"), help="client key")
    g.add_argument(
        "--ssl-no-check-hostname",
        action="store_true",
        default=env_bool(env_get("SSL_NO_CHECK_HOSTNAME")),
        help="do not verify the server certificate's hostname",
    )


def add_queue_args(parser: argparse.ArgumentParser, *, group: bool = True) -> None:
    """``--queue``, ``--partitions`` (and ``--group``)."""
    q = parser.add_argument_group("queue")
    q.add_argument(
        "--queue",
        default=env_get("QUEUE", keys.DEFAULT_QUEUE),
        help="logical queue name (env SCORING_QUEUE; default 'default')",
    )
    raw = env_get("PARTITIONS")
    q.add_argument(
        "--partitions",
        type=int,
        default=int(raw) if raw else 1,
        help="partition streams of the queue, as the workers use (env SCORING_PARTITIONS)",
    )
    if group:
        q.add_argument(
            "--group",
            default=env_get("GROUP", keys.DEFAULT_GROUP),
            help="consumer group (env SCORING_GROUP; default 'scoring')",
        )


def redis_settings(args: argparse.Namespace, url: str | None = None) -> RedisSettings:
    """``RedisSettings`` from parsed flags (``url`` overrides ``--redis-url``)."""
    return RedisSettings(
        url=url or args.redis_url or DEFAULT_REDIS_URL,
        cluster=args.cluster,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        ssl_check_hostname=not args.ssl_no_check_hostname,
    )
