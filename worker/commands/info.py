"""``scoring-worker info``: streams, groups, lag, pending, oldest pending age, consumers with idle
time and dead-letter depth of a queue (all partitions), and the live workers with what each
holds (model, resident adapters/versions with bytes and fingerprints, from their heartbeats; a
worker of several queues with its weight on each), as a table or ``--json``; ``--queue``
repeated: one block per queue (``--json``: a list). Above the tables, what Redis keeps (each
primary's eviction policy, persistence and memory; ``--json``: ``redis``) with a warning for a
policy that evicts (and the workers that serve anyway, ``--allow-redis-eviction``) or no
persistence."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import redis

from worker.commands._options import (
    add_queue_args,
    add_redis_args,
    parse_queue_specs,
    redis_settings,
)
from worker.connections import (
    connect,
    eviction_problem,
    persistence_problem,
    server_states,
    server_summary,
)
from worker.streams.admin import known_queues, queue_exists, queue_info


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the info flags."""
    add_redis_args(parser)
    add_queue_args(parser, multi=True)  # several queues: one block each (weights are ignored)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--list",
        action="store_true",
        help="list the queues this server holds (job streams and worker heartbeats) and exit",
    )


def _fmt(value: Any, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}{suffix}"
    return f"{value}{suffix}"


def render(info: dict[str, Any]) -> str:
    """The readable table of a ``queue_info`` result."""
    head = ("STREAM", "LENGTH", "LAG", "PENDING", "OLDEST PENDING", "CONSUMERS", "DEAD")
    rows = [
        (
            s["stream"] + ("" if s["group_exists"] else "  (no group)"),
            _fmt(s["length"]),
            _fmt(s["lag"]),
            _fmt(s["pending"]),
            _fmt(s["oldest_pending_age_s"], " s"),
            _fmt(len(s["consumers"])),
            _fmt(s["dead_letters"]),
        )
        for s in info["streams"]
    ]
    t = info["total"]
    if len(rows) > 1:
        rows.append(
            (
                "total",
                _fmt(t["length"]),
                _fmt(t["lag"]),
                _fmt(t["pending"]),
                _fmt(t["oldest_pending_age_s"], " s"),
                _fmt(t["consumers"]),
                _fmt(t["dead_letters"]),
            )
        )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(r: tuple[str, ...]) -> str:
        first = r[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True))])

    out = [
        f"queue {info['queue']}  group {info['group']}  partitions {info['partitions']}",
        "",
        line(head),
        *(line(r) for r in rows),
    ]
    consumers = [(s["stream"], c) for s in info["streams"] for c in s["consumers"]]
    if consumers:
        out += ["", "CONSUMER".ljust(32) + "  PENDING   IDLE  STREAM"]
        for stream, c in sorted(consumers, key=lambda sc: sc[1]["name"]):
            out.append(
                f"{c['name'][:32].ljust(32)}  {c['pending']:>7}  {c['idle_s']:>5.1f}s  {stream}"
            )
    return "\n".join(out + _workers(info.get("workers") or []))


def render_redis(summary: dict[str, Any]) -> str:
    """The lines about what Redis keeps (``server_summary``), warnings included."""
    out = []
    for p in summary["primaries"]:
        aof, rdb = ("-" if v is None else ("on" if v else "off") for v in (p["aof"], p["rdb"]))
        memory = "-"
        if p["used_memory_bytes"] is not None:
            memory = _mib(p["used_memory_bytes"])
            if p["memory_used_ratio"] is not None:
                memory += f" ({100 * p['memory_used_ratio']:.1f}% of {p['memory_limit']})"
        out.append(
            f"redis {p['node']}  maxmemory-policy {p['policy'] or '-'}  aof {aof}  rdb {rdb}  "
            f"memory {memory}" + ("" if p["via"] == "config" else "  (CONFIG refused: INFO)")
        )
    for warning in (summary.get("eviction_warning"), summary.get("persistence_warning")):
        if warning:
            out.append(f"  warning: {warning}")
    return "\n".join(out)


def _mib(nbytes: Any) -> str:
    return f"{int(nbytes) / (1 << 20):.1f} MiB"


def _workers(workers: list[dict[str, Any]]) -> list[str]:
    """The WORKER table: one line per live worker, one indented line per resident item."""
    if not workers:
        return []
    out = ["", "WORKER".ljust(32) + "  MODEL / RESIDENT"]
    for w in workers:
        held = w.get("resident") or {}
        adapters, versions = held.get("adapters") or {}, held.get("versions") or {}
        summary = f"{w.get('model', '-')} ({w.get('dtype', '-')}, {w.get('device', '-')})"
        if w.get("queues") and "," in str(w["queues"]):  # a worker of several queues
            summary += f"  weight {w.get('weight', '-')} of {w['queues']}"
        if w.get("tensor_parallel"):  # a tensor-parallel group: its size and devices
            devices = ", ".join(map(str, w.get("tensor_parallel_devices") or []))
            summary += f"  tensor parallel {w['tensor_parallel']}: {devices}"
        if w.get("redis_eviction_allowed"):
            summary += "  --allow-redis-eviction"
        if held:
            summary += (
                f"  {len(adapters)} adapters, {len(versions)} versions, "
                f"{_mib(held.get('bytes', 0))}"
            )
        out.append(f"{str(w.get('consumer', '?'))[:32].ljust(32)}  {summary}")
        for kind, items in (("adapter", adapters), ("version", versions)):
            for name, item in items.items():
                out.append(
                    f"{'':32}    {kind} {name}  {_mib(item.get('bytes', 0))}  "
                    f"fingerprint {item.get('fingerprint', '-')}"
                )
    return out


def run(args: argparse.Namespace) -> int:
    """Print the state of each queue asked for (``--queue`` repeatable). Exit 1 when Redis
    cannot be read, 2 when a queue is unknown (no job stream, no group, no live worker: a
    typo, most likely; the known queues are named)."""
    settings = redis_settings(args)
    names = [name for name, _ in parse_queue_specs(args.queue)]
    client = connect(settings)
    infos: list[dict[str, Any]] = []
    try:
        if args.list:
            queues = known_queues(client)
            print(json.dumps(queues) if args.json else "\n".join(queues) or "(no queues)")
            return 0
        for name in names:
            infos.append(queue_info(client, name, args.partitions, args.group))
        redis_server = _redis_server(client, infos)
        for info in infos:
            info["redis"] = redis_server
        missing = [i["queue"] for i in infos if not queue_exists(i)]
        queues = known_queues(client) if missing else []
    except redis.RedisError as exc:
        print(
            f"error: cannot read {', '.join(map(repr, names))} from Redis: {exc}", file=sys.stderr
        )
        return 1
    finally:
        client.close()
    if missing:
        print(
            f"error: no queue {missing[0]!r} on {settings.redacted_url}: no job stream, no "
            "consumer group and no live worker",
            file=sys.stderr,
        )
        known = ", ".join(queues) if queues else "none"
        print(f"  queues there: {known} (--queue NAME)", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(infos[0] if len(infos) == 1 else infos, indent=2))
    else:
        print(render_redis(redis_server) + "\n")
        print("\n\n".join(render(i) for i in infos))
    return 0


def _redis_server(client: Any, infos: list[dict[str, Any]]) -> dict[str, Any]:
    """``server_summary`` of the server, with ``eviction_allowed`` the consumers that serve with
    ``--allow-redis-eviction`` and the warnings (None when all is well)."""
    states = server_states(client)
    allowed = sorted(
        str(w.get("consumer"))
        for i in infos
        for w in i.get("workers") or []
        if w.get("redis_eviction_allowed")
    )
    summary = server_summary(states, allowed=bool(allowed))
    summary["eviction_allowed_by"] = allowed
    problem = eviction_problem(states)
    if problem and allowed:
        problem += f" (serving anyway: {', '.join(allowed)})"
    summary["eviction_warning"] = problem
    summary["persistence_warning"] = persistence_problem(states)
    return summary
