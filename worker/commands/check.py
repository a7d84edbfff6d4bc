"""``scoring-worker check``: exit 0 when every check passes, 1 otherwise.

``--url http://host:9400/readyz`` (repeatable) checks a worker's health endpoint (HTTP 200 is
healthy); with no ``--url``, or with ``--redis``, the Redis connection is checked (PING).
Usable as a Kubernetes exec probe or in scripts.
"""

from __future__ import annotations

import argparse
import urllib.error
import urllib.request

import redis

from worker.commands._options import add_redis_args, redis_settings
from worker.config import env_get
from worker.connections import connect


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the check flags."""
    add_redis_args(parser)
    parser.add_argument(
        "--url",
        action="append",
        default=[u for u in (env_get("CHECK_URL"),) if u],
        help="a worker health URL, e.g. http://127.0.0.1:9400/readyz (repeatable)",
    )
    parser.add_argument("--redis", action="store_true", help="also check Redis with --url")
    parser.add_argument("--timeout-s", type=float, default=3.0, help="per-check timeout")
    parser.add_argument("--quiet", "-q", action="store_true", help="no output, exit code only")


def check_url(url: str, timeout_s: float) -> tuple[bool, str]:
    """(healthy, detail) for one health endpoint."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            body = resp.read(400).decode(errors="replace").strip()
            return resp.status == 200, f"{resp.status} {body}"
    except urllib.error.HTTPError as exc:
        body = exc.read(400).decode(errors="replace").strip()
        return False, f"{exc.code} {body}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"unreachable: {getattr(exc, 'reason', exc)}"


def check_redis(args: argparse.Namespace) -> tuple[bool, str]:
    """(ok, detail) for the Redis connection."""
    settings = redis_settings(args)
    settings = type(settings)(
        **{
            **settings.__dict__,
            "connect_timeout_s": args.timeout_s,
            "socket_timeout_s": args.timeout_s,
        }
    )
    try:
        client = connect(settings)
        try:
            client.ping()
        finally:
            client.close()
    except redis.RedisError as exc:
        return False, f"{settings.redacted_url}: {exc}"
    return True, f"{settings.redacted_url}: PONG"


def run(args: argparse.Namespace) -> int:
    """Run the checks; exit 0 when all pass."""
    results: list[tuple[str, bool, str]] = []
    for url in args.url:
        ok, detail = check_url(url, args.timeout_s)
        results.append((url, ok, detail))
    if not args.url or args.redis:
        ok, detail = check_redis(args)
        results.append(("redis", ok, detail))
    if not args.quiet:
        for name, ok, detail in results:
            print(f"{'ok  ' if ok else 'FAIL'}  {name}  {detail}")
    return 0 if all(ok for _, ok, _ in results) else 1
