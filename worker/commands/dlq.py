"""``scoring-worker dlq list|replay|purge``: inspect and act on the dead-letter streams of a queue.

``list`` shows each dead letter with its reason, job id and delivery count; ``replay`` puts the
original job back on its job stream (one id, several, or ``--all``) and removes the dead letter;
``purge`` deletes dead letters (``--yes`` required).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import redis

from worker.commands._options import add_queue_args, add_redis_args, redis_settings
from worker.connections import connect
from worker.queue_admin import dlq_list, dlq_purge, dlq_replay


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the dlq actions (each with the common Redis/queue flags)."""
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    helps = {
        "list": "show dead letters: reason, job id, delivery count, age",
        "replay": "put jobs back on their job stream (ids or --all)",
        "purge": "delete dead letters for good (ids or --all, with --yes)",
    }
    for action, help_text in helps.items():
        p = sub.add_parser(action, help=help_text, description=help_text)
        add_redis_args(p, url_default="redis://127.0.0.1:6379/0")
        add_queue_args(p, group=False)
        if action == "list":
            p.add_argument("--limit", type=int, default=100, help="entries per partition")
            p.add_argument("--json", action="store_true", help="one JSON object per line")
            continue
        p.add_argument("ids", nargs="*", help="job ids or dead-letter entry ids")
        p.add_argument("--all", action="store_true", help=f"{action} every dead letter")
        if action == "purge":
            p.add_argument("--yes", action="store_true", help="confirm the purge")


def run(args: argparse.Namespace) -> int:
    """Run the dlq action; exit 2 on a usage error, 1 when Redis fails."""
    client = connect(redis_settings(args))
    try:
        if args.action == "list":
            entries = dlq_list(client, args.queue, args.partitions, limit=args.limit)
            if args.json:
                for e in entries:
                    print(json.dumps(e.to_json()))
                return 0
            if not entries:
                print(f"no dead letters in queue {args.queue!r}")
                return 0
            print(f"{'DLQ ID':<20} {'JOB ID':<34} {'DELIV':>5}  {'AGE':>8}  REASON")
            now_ms = time.time() * 1000
            for e in entries:
                age = f"{(now_ms - e.dead_at_ms) / 1000:.0f}s"
                print(
                    f"{e.dlq_id:<20} {(e.job_id or '?'):<34} "
                    f"{e.deliveries if e.deliveries is not None else '-':>5}  {age:>8}  {e.reason}"
                )
            return 0
        ids = args.ids or None
        if ids is None and not args.all:
            print(f"error: dlq {args.action} needs job ids or --all", file=sys.stderr)
            return 2
        if args.action == "replay":
            done = dlq_replay(client, args.queue, args.partitions, ids=ids)
            for e in done:
                print(f"replayed {e.job_id or e.dlq_id} -> {e.job_stream}")
            print(f"{len(done)} replayed")
            return 0 if done or ids is None else 1
        if not args.yes:
            print("error: dlq purge deletes dead letters for good; add --yes", file=sys.stderr)
            return 2
        n = dlq_purge(client, args.queue, args.partitions, ids=ids)
        print(f"{n} purged")
        return 0
    except redis.RedisError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
