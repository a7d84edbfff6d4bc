"""``scoring-worker dlq list|replay|purge``: inspect and act on the dead-letter streams of a queue.

``list`` shows each dead letter with its partition, job stream, reason, job id and delivery
count, then how many dead letters each partition holds and the total; ``replay`` puts the
original job back on its job stream (one id, several, or ``--all``) and removes the dead letter;
``purge`` deletes dead letters (``--yes`` required). ``--partition N`` limits any action to one
partition of the queue.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import redis

from worker.commands._options import add_queue_args, add_redis_args, redis_settings
from worker.connections import connect
from worker.streams.admin import DeadLetterEntry, dlq_counts, dlq_list, dlq_purge, dlq_replay


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
        add_redis_args(p)
        add_queue_args(p, group=False)
        p.add_argument(
            "--partition",
            type=int,
            default=None,
            metavar="N",
            help="only partition N (0..partitions-1) of the queue (default: every partition)",
        )
        if action == "list":
            p.add_argument("--limit", type=int, default=100, help="entries per partition")
            p.add_argument(
                "--json",
                action="store_true",
                help='one JSON object per dead letter, then a last line {"summary": ...}',
            )
            continue
        p.add_argument("ids", nargs="*", help="job ids or dead-letter entry ids")
        p.add_argument("--all", action="store_true", help=f"{action} every dead letter")
        if action == "purge":
            p.add_argument("--yes", action="store_true", help="confirm the purge")


def _print_list(
    entries: list[DeadLetterEntry], counts: dict[str, Any], queue: str, limit: int
) -> None:
    """The dead letters as a table, then the count of every partition and the total."""
    rows = counts["by_partition"]
    where = f"queue {queue!r}" + (
        f" partition {rows[0]['partition']}" if len(rows) == 1 and counts["partitions"] > 1 else ""
    )
    if not entries:
        print(f"no dead letters in {where}")
        return
    width = max(len("STREAM"), *(len(e.job_stream) for e in entries))
    print(
        f"{'PART':>5}  {'STREAM':<{width}}  {'DLQ ID':<20} {'JOB ID':<34} {'DELIV':>5}  "
        f"{'AGE':>8}  REASON"
    )
    now_ms = time.time() * 1000
    for e in entries:
        age = f"{(now_ms - e.dead_at_ms) / 1000:.0f}s"
        part = "-" if e.partition is None else str(e.partition)
        deliveries = e.deliveries if e.deliveries is not None else "-"
        print(
            f"{part:>5}  {e.job_stream:<{width}}  {e.dlq_id:<20} {(e.job_id or '?'):<34} "
            f"{deliveries:>5}  {age:>8}  {e.reason}"
        )
    print()
    width = max(len("STREAM"), *(len(r["stream"]) for r in rows))
    print(f"{'PART':>5}  {'STREAM':<{width}}  {'DEAD':>6}")
    for r in rows:
        print(f"{r['partition']:>5}  {r['stream']:<{width}}  {r['dead_letters']:>6}")
    print(f"{'total':>5}  {'':<{width}}  {counts['total']:>6}")
    if len(entries) < counts["total"]:
        print(
            f"(listed the oldest {limit} per partition: {len(entries)} of {counts['total']}; "
            "see --limit)"
        )


def run(args: argparse.Namespace) -> int:
    """Run the dlq action; exit 2 on a usage error, 1 when Redis fails."""
    part = args.partition
    if part is not None and not 0 <= part < args.partitions:
        print(
            f"error: --partition must be in 0..{args.partitions - 1} "
            f"(--partitions {args.partitions}), got {part}",
            file=sys.stderr,
        )
        return 2
    if args.action == "list" and args.limit < 1:
        print(f"error: --limit must be >= 1, got {args.limit}", file=sys.stderr)
        return 2
    client = connect(redis_settings(args))
    try:
        if args.action == "list":
            entries = dlq_list(
                client, args.queue, args.partitions, limit=args.limit, partition=part
            )
            counts = dlq_counts(client, args.queue, args.partitions, partition=part)
            if args.json:
                for e in entries:
                    print(json.dumps(e.to_json()))
                listed: dict[int | None, int] = {}
                for e in entries:
                    listed[e.partition] = listed.get(e.partition, 0) + 1
                for r in counts["by_partition"]:
                    r["listed"] = listed.get(r["partition"], 0)
                summary = {**counts, "listed": len(entries), "limit": args.limit}
                print(json.dumps({"summary": summary}))
                return 0
            _print_list(entries, counts, args.queue, args.limit)
            return 0
        ids = args.ids or None
        if ids is None and not args.all:
            print(f"error: dlq {args.action} needs job ids or --all", file=sys.stderr)
            return 2
        if args.action == "replay":
            done = dlq_replay(client, args.queue, args.partitions, ids=ids, partition=part)
            for e in done:
                print(f"replayed {e.job_id or e.dlq_id} -> {e.job_stream}")
            print(f"{len(done)} replayed")
            return 0 if done or ids is None else 1
        if not args.yes:
            print("error: dlq purge deletes dead letters for good; add --yes", file=sys.stderr)
            return 2
        n = dlq_purge(client, args.queue, args.partitions, ids=ids, partition=part)
        print(f"{n} purged")
        return 0
    except redis.RedisError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
