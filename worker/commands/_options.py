"""Flags shared by every command that talks to Redis (``serve``, ``enqueue``, ``info``, ``dlq``,
``check``, ``demo``): the Redis connection, TLS, queue, partitions and group, each with a
``SCORING_*`` env equivalent (a flag on the command line wins). The one definition of these
flags: a command adds them with :func:`add_redis_args` / :func:`add_queue_args` and builds its
``RedisSettings`` with :func:`redis_settings`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from worker import keys
from worker.config import DEFAULT_REDIS_URL, RedisSettings, env_bool, env_get
from worker.errors import ConfigError


def add_redis_args(
    parser: argparse.ArgumentParser, *, url_default: str | None = DEFAULT_REDIS_URL
) -> None:
    """``--redis-url``, ``--cluster`` and the TLS options (``url_default`` None: the command
    decides what no URL means, as ``demo`` does with its embedded server)."""
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
    g.add_argument(
        "--cluster-node",
        action="append",
        default=[n for n in (env_get("CLUSTER_NODES") or "").split(",") if n] or None,
        metavar="HOST:PORT",
        help="another Redis Cluster seed node, repeatable (the URL may also list several, "
        "comma-separated: redis+cluster://h1:7000,h2:7000; env SCORING_CLUSTER_NODES, "
        "comma-separated); the last known topology is tried before the seeds",
    )
    g.add_argument(
        "--ssl-ca-certs",
        default=env_get("SSL_CA_CERTS"),
        help="CA bundle for rediss:// (env SCORING_SSL_CA_CERTS)",
    )
    g.add_argument(
        "--ssl-certfile",
        default=env_get("SSL_CERTFILE"),
        help="client certificate for mutual TLS (env SCORING_SSL_CERTFILE)",
    )
    g.add_argument(
        "--ssl-keyfile",
        default=env_get("SSL_KEYFILE"),
        help="client key for mutual TLS (env SCORING_SSL_KEYFILE)",
    )
    g.add_argument(
        "--ssl-no-check-hostname",
        action="store_true",
        default=env_bool(env_get("SSL_NO_CHECK_HOSTNAME")),
        help="do not verify the server certificate's hostname (env SCORING_SSL_NO_CHECK_HOSTNAME)",
    )


def _env_partitions() -> int:
    raw = env_get("PARTITIONS")
    return int(raw) if raw else 1


class QueueAction(argparse.Action):
    """``--queue NAME[:WEIGHT]``, repeatable: the first one given replaces the default list."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        items = [] if current is None or current is self.default else list(current)
        setattr(namespace, self.dest, [*items, str(values)])


def parse_queue_specs(values: Sequence[str] | str) -> list[tuple[str, int]]:
    """``["train:3", "eval"]`` -> ``[("train", 3), ("eval", 1)]``; a ``ConfigError`` naming
    the flag for a bad name, a weight that is not a positive integer, or a queue given twice."""
    items = [values] if isinstance(values, str) else list(values)
    hint = "--queue NAME[:WEIGHT], repeatable (env SCORING_QUEUE=a:3,b:1), weights >= 1"
    out: list[tuple[str, int]] = []
    for raw in items:
        name, sep, weight = raw.strip().partition(":")
        try:
            keys.validate_queue(name)
        except ConfigError as exc:
            raise ConfigError(f"--queue {raw!r}: {exc}", hint=hint) from exc
        if not sep:
            out.append((name, 1))
            continue
        if not (weight.isascii() and weight.isdigit()) or int(weight) < 1:
            raise ConfigError(f"--queue {raw!r}: the weight must be a positive integer", hint=hint)
        out.append((name, int(weight)))
    names = [n for n, _ in out]
    for n in names:
        if names.count(n) > 1:
            raise ConfigError(f"--queue {n!r} is given more than once", hint=hint)
    if not out:
        raise ConfigError("--queue is empty", hint=hint)
    return out


def _env_queues() -> list[str]:
    raw = env_get("QUEUE") or keys.DEFAULT_QUEUE
    return [q.strip() for q in raw.split(",") if q.strip()] or [keys.DEFAULT_QUEUE]


def add_queue_args(
    parser: argparse.ArgumentParser, *, group: bool = True, multi: bool = False
) -> argparse._ArgumentGroup:
    """``--queue``, ``--partitions`` (and ``--group``); returns the argument group so a command
    can add its own queue flags to it (``serve``: ``--stream``, ``--consumer``, ...). ``multi``:
    ``--queue`` is repeatable, ``NAME[:WEIGHT]`` each (a list; :func:`parse_queue_specs`)."""
    q = parser.add_argument_group("queue")
    if multi:
        q.add_argument(
            "--queue",
            action=QueueAction,
            default=_env_queues(),
            metavar="NAME[:WEIGHT]",
            help="logical queue, repeatable with an optional weight (--queue train:3 --queue "
            "eval:1: each backlogged queue gets its weight's share of the batches' tokens); its "
            "streams are derived from it (env SCORING_QUEUE, comma-separated; default "
            f"{keys.DEFAULT_QUEUE!r})",
        )
    else:
        q.add_argument(
            "--queue",
            default=env_get("QUEUE", keys.DEFAULT_QUEUE),
            help="logical queue name; its streams are derived from it "
            f"(env SCORING_QUEUE; default {keys.DEFAULT_QUEUE!r})",
        )
    q.add_argument(
        "--partitions",
        type=int,
        default=_env_partitions(),
        help="partition streams of the queue, as the workers use (env SCORING_PARTITIONS)",
    )
    if group:
        q.add_argument(
            "--group",
            default=env_get("GROUP", keys.DEFAULT_GROUP),
            help=f"consumer group (env SCORING_GROUP; default {keys.DEFAULT_GROUP!r})",
        )
    return q


def redis_settings(
    args: argparse.Namespace, url: str | None = None, *, client_name: str | None = None
) -> RedisSettings:
    """``RedisSettings`` from parsed flags (``url`` overrides ``--redis-url``; ``client_name``
    is what ``CLIENT LIST`` shows for the connection)."""
    return RedisSettings(
        url=url or args.redis_url or DEFAULT_REDIS_URL,
        cluster=args.cluster,
        seed_nodes=tuple(getattr(args, "cluster_node", None) or ()),
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        ssl_check_hostname=not args.ssl_no_check_hostname,
        client_name=client_name,
    )
