"""``scoring-worker serve``: run one worker daemon (or a supervised fleet with --replicas/--gpus).

Every flag has a ``SCORING_<FLAG>`` environment equivalent (``--max-batch-tokens`` ->
``SCORING_MAX_BATCH_TOKENS``); a flag on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import logging
import os
import socket
from typing import Any

from worker import keys
from worker.commands._fleet import add_fleet_args, run_fleet, wants_fleet
from worker.commands._options import add_queue_args, add_redis_args, redis_settings
from worker.commands._weights import add_weights_args, weights_config
from worker.config import env_bool, env_get
from worker.daemon.config import WorkerConfig
from worker.errors import ConfigError
from worker.protocol import DEFAULT_LIMITS, Limits
from worker.scorer import Scorer

log = logging.getLogger(__name__)


def _env_int(name: str, default: int | None) -> int | None:
    raw = env_get(name)
    return int(raw) if raw not in (None, "") else default


def _floats(text: str | None) -> tuple[float, ...]:
    """``"1,0.5,-2"`` -> ``(1.0, 0.5, -2.0)``."""
    try:
        return tuple(float(x) for x in (text or "").split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers: {exc}") from exc


def _env_float(name: str, default: float) -> float:
    raw = env_get(name)
    return float(raw) if raw not in (None, "") else default


def default_consumer() -> str:
    """``POD_NAME`` when set (Kubernetes), else ``<hostname>-<pid>``."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the serve flags (defaults come from ``SCORING_*`` env)."""
    add_redis_args(parser)
    q = add_queue_args(parser)
    q.add_argument(
        "--stream",
        default=env_get("STREAM"),
        help="explicit comma-separated job stream keys (overrides --queue)",
    )
    q.add_argument(
        "--consumer",
        default=env_get("CONSUMER"),
        help="consumer name (default: env POD_NAME, else hostname-pid)",
    )
    q.add_argument(
        "--dead-letter-stream",
        default=env_get("DEAD_LETTER_STREAM"),
        help="dead-letter stream (default: <stream base>:dead, same hash tag)",
    )
    m = parser.add_argument_group("model")
    m.add_argument(
        "--scorer",
        choices=["executor", "noop"],
        default=env_get("SCORER", "executor"),
        help="noop = no model, deterministic fake scores (queue capacity benchmarks)",
    )
    m.add_argument("--reference-model", default=env_get("REFERENCE_MODEL"))
    m.add_argument("--reward-model", default=env_get("REWARD_MODEL"))
    m.add_argument("--gguf-file", default=env_get("GGUF_FILE"))
    m.add_argument("--reward-gguf-file", default=env_get("REWARD_GGUF_FILE"))
    m.add_argument(
        "--reward-adapter",
        default=env_get("REWARD_ADAPTER"),
        help="'module:factory' returning a RewardAdapter for a non-standard reward head (imports "
        "and runs that code); default: the *ForSequenceClassification head (num_labels=1)",
    )
    m.add_argument(
        "--reward-token-scores",
        action="store_true",
        default=env_bool(env_get("REWARD_TOKEN_SCORES")),
        help="also return the reward head's score at every token (token_scores in results)",
    )
    m.add_argument(  # multi-objective reward heads
        "--reward-index",
        type=int,
        default=_env_int("REWARD_INDEX", 0),
        help="the output of a multi-objective reward head that is `reward` (all come back as "
        "`rewards`; names from the config's id2label in info)",
    )
    m.add_argument(  # multi-objective reward heads: a linear combination instead of one output
        "--reward-weights",
        type=_floats,
        default=_floats(env_get("REWARD_WEIGHTS")) if env_get("REWARD_WEIGHTS") else None,
        help="comma-separated, one per output of a multi-objective reward head: `reward` = "
        "sum of weight x output (float32); exclusive with --reward-index",
    )
    m.add_argument(  # process reward models
        "--reward-head",
        choices=["auto", "sequence", "token-classification", "lm-label"],
        default=env_get("REWARD_HEAD", "auto"),
        help="how the reward checkpoint is read: auto = from its architecture "
        "(*ForSequenceClassification: a reward per sequence; *ForTokenClassification / "
        "*ForCausalLM: process rewards at step positions, docs/rewards.md)",
    )
    m.add_argument("--device", default=env_get("DEVICE", "auto"))
    m.add_argument("--dtype", default=env_get("DTYPE", "auto"))
    m.add_argument("--attention-backend", default=env_get("ATTENTION_BACKEND", "auto"))
    m.add_argument(
        "--packing",
        choices=["auto", "packed", "unmasked", "padded"],
        default=env_get("PACKING", "auto"),
        help="batch layout (executor): auto = per attention backend, packed rows, unmasked "
        "(mask-free right-padded) buckets, or padded buckets with a mask",
    )
    m.add_argument(
        "--trust-remote-code", action="store_true", default=env_bool(env_get("TRUST_REMOTE_CODE"))
    )
    m.add_argument(
        "--noop-delay-ms",
        type=float,
        default=_env_float("NOOP_DELAY_MS", 0.0),
        help="noop scorer only: sleep this long per batch",
    )
    add_weights_args(parser)  # per-job adapters and versions
    b = parser.add_argument_group("batching and delivery")
    b.add_argument("--max-batch-tokens", type=int, default=_env_int("MAX_BATCH_TOKENS", 16384))
    b.add_argument(
        "--max-wait-ms",
        type=int,
        default=_env_int("MAX_WAIT_MS", 5),
        help="how long to wait for more jobs to fill a batch",
    )
    b.add_argument("--block-ms", type=int, default=_env_int("BLOCK_MS", 1000))
    b.add_argument(
        "--claim-idle-ms",
        type=int,
        default=_env_int("CLAIM_IDLE_MS", 30000),
        help="entries idle this long (their worker died) are reclaimed",
    )
    b.add_argument("--max-deliveries", type=int, default=_env_int("MAX_DELIVERIES", 5))
    b.add_argument(
        "--isolate-after-deliveries",
        type=int,
        default=_env_int("ISOLATE_AFTER_DELIVERIES", 2),
        help="an entry delivered more often (its batch never finished: a job may crash the "
        "worker) is claimed alone and runs in a batch of its own",
    )
    b.add_argument(
        "--keep-consumer",
        action="store_true",
        default=env_bool(env_get("KEEP_CONSUMER")),
        help="on a clean stop, keep this consumer in its groups (default: leave them when it "
        "holds nothing, so replaced pods do not pile up as dead consumers)",
    )
    b.add_argument(
        "--result-maxlen",
        type=int,
        default=_env_int("RESULT_MAXLEN", 10000),
        help="reply streams are trimmed to about this many entries",
    )
    b.add_argument(
        "--reply-ttl-s",
        type=int,
        default=_env_int("REPLY_TTL_S", 3600),
        help="a reply stream with no TTL gets this one when a result is written (a late result "
        "after its client closed leaves no key behind); 0: never set one",
    )
    # durable result writes (docs/guarantees.md, "The worker's side")
    b.add_argument(
        "--durable-replicas",
        type=int,
        default=_env_int("DURABLE_REPLICAS", 0),
        help="after writing a result to another Cluster node than its job, WAIT for this many "
        "replicas and ack only then (a shortfall: not acked, written again); 0: off",
    )
    b.add_argument("--durable-timeout-ms", type=int, default=_env_int("DURABLE_TIMEOUT_MS", 1000))
    b.add_argument(
        "--durable-all-results",
        action="store_true",
        default=env_bool(env_get("DURABLE_ALL_RESULTS")),
        help="with --durable-replicas, WAIT after the atomic result + ack script too",
    )
    b.add_argument("--drain-timeout-s", type=float, default=_env_float("DRAIN_TIMEOUT_S", 60.0))
    b.add_argument(
        "--batch-timeout-s",
        type=float,
        default=_env_float("BATCH_TIMEOUT_S", 1800.0),
        help="/healthz reports the worker stalled once one batch computes longer than this",
    )
    lim = parser.add_argument_group("job limits (a job breaking one gets bad_request)")
    lim.add_argument(
        "--max-payload-bytes",
        type=int,
        default=_env_int("MAX_PAYLOAD_BYTES", DEFAULT_LIMITS.max_payload_bytes),
        help="largest job payload in bytes (default 64 MiB); bound entries in Redis too with "
        "proto-max-bulk-len",
    )
    lim.add_argument(
        "--max-seqs-per-job",
        type=int,
        default=_env_int("MAX_SEQS_PER_JOB", DEFAULT_LIMITS.max_seqs),
        help="most sequences in one job (default 4096)",
    )
    lim.add_argument(
        "--max-tokens-per-job",
        type=int,
        default=_env_int("MAX_TOKENS_PER_JOB", DEFAULT_LIMITS.max_tokens),
        help="most tokens in one job, summed over its sequences (default 4194304)",
    )
    lim.add_argument(
        "--max-meta-bytes",
        type=int,
        default=_env_int("MAX_META_BYTES", DEFAULT_LIMITS.max_meta_bytes),
        help="largest packed meta, and longest str anywhere in a job, in bytes (default 65536)",
    )
    lim.add_argument(  # teacher outputs
        "--max-result-bytes",
        type=int,
        default=_env_int("MAX_RESULT_BYTES", 64 * 1024 * 1024),
        help="largest result a job may ask for (per-token arrays: logps, top-k, gather, ...), "
        "known at intake (default 64 MiB); size Redis proto-max-bulk-len and memory for it",
    )
    lim.add_argument(
        "--max-topk",
        type=int,
        default=_env_int("MAX_TOPK", 256),
        help="largest k a job's top-k output may ask for (1..256, default 256)",
    )
    b.add_argument(
        "--burst",
        action="store_true",
        default=env_bool(env_get("BURST")),
        help="exit once the streams are drained and nothing is pending for us",
    )
    b.add_argument("--max-jobs", type=int, default=_env_int("MAX_JOBS", None))
    b.add_argument(
        "--no-pipeline",
        dest="pipeline",
        action="store_false",
        default=env_bool(env_get("PIPELINE"), default=True),
        help="score each batch in the main loop instead of on a compute thread that overlaps "
        "Redis reads and writes (env SCORING_PIPELINE=0; for comparison)",
    )
    o = parser.add_argument_group("metrics")
    o.add_argument("--metrics-host", default=env_get("METRICS_HOST", "127.0.0.1"))
    o.add_argument(
        "--metrics-port",
        type=int,
        default=_env_int("METRICS_PORT", 9400),
        help="0 = a free port (logged); -1 = no HTTP endpoint",
    )
    add_fleet_args(parser)  # --replicas/--gpus and the restart policy of their supervisor


def flag_defaults() -> dict[str, Any]:
    """Every serve flag's default (dest -> value), from the same ``SCORING_*`` environment."""
    parser = argparse.ArgumentParser(add_help=False)
    configure(parser)
    return vars(parser.parse_args([]))


def streams_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """Job stream keys: ``--stream`` (comma-separated), else from ``--queue``/``--partitions``."""
    if args.stream:
        out = tuple(s.strip() for s in args.stream.split(",") if s.strip())
        if not out:
            raise ConfigError("--stream is empty")
        return out
    return tuple(keys.job_streams(args.queue, args.partitions))


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The ``WorkerConfig`` for parsed serve args."""
    return WorkerConfig(
        streams=streams_from_args(args),
        group=args.group,
        consumer=args.consumer or default_consumer(),
        max_batch_tokens=args.max_batch_tokens,
        max_wait_ms=args.max_wait_ms,
        block_ms=args.block_ms,
        claim_idle_ms=args.claim_idle_ms,
        max_deliveries=args.max_deliveries,
        isolate_after_deliveries=args.isolate_after_deliveries,
        forget_consumer=not args.keep_consumer,
        dead_letter_stream=args.dead_letter_stream,
        drain_timeout_s=args.drain_timeout_s,
        batch_timeout_s=args.batch_timeout_s,
        result_maxlen=args.result_maxlen,
        reply_ttl_s=args.reply_ttl_s,
        durable_replicas=args.durable_replicas,
        durable_timeout_ms=args.durable_timeout_ms,
        durable_all_results=args.durable_all_results,
        burst=args.burst,
        max_jobs=args.max_jobs,
        pipeline=args.pipeline,
        metrics_host=args.metrics_host,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        limits=limits_from_args(args),
        max_result_bytes=args.max_result_bytes,
        max_topk=args.max_topk,
    )


#: ``Limits`` field -> the serve flag that sets it.
LIMIT_FLAGS = {
    "max_payload_bytes": "--max-payload-bytes",
    "max_seqs": "--max-seqs-per-job",
    "max_tokens": "--max-tokens-per-job",
    "max_meta_bytes": "--max-meta-bytes",
}


def limits_from_args(args: argparse.Namespace) -> Limits:
    """The decode ``Limits`` of parsed serve args (``ConfigError`` for a value <= 0)."""
    values = {
        "max_payload_bytes": args.max_payload_bytes,
        "max_seqs": args.max_seqs_per_job,
        "max_tokens": args.max_tokens_per_job,
        "max_meta_bytes": args.max_meta_bytes,
    }
    for name, value in values.items():
        if value <= 0:
            flag = LIMIT_FLAGS[name]
            env = "SCORING_" + flag[2:].upper().replace("-", "_")
            raise ConfigError(f"{flag} (env {env}) must be > 0, got {value}")
    return Limits(**values)


def build_scorer(args: argparse.Namespace) -> Scorer:
    """The noop scorer or a loaded ``StatelessExecutor`` (the one place serve imports it)."""
    if args.scorer == "noop":
        from worker.scorer.noop import NoopScorer

        return NoopScorer(delay_ms=args.noop_delay_ms)
    if not (args.reference_model or args.reward_model):
        raise ConfigError("serve needs --reference-model and/or --reward-model (or --scorer noop)")
    from worker.executor import ExecutorConfig, StatelessExecutor

    both = bool(args.reference_model and args.reward_model)
    wanted = {
        "mode": "both" if both else ("reference" if args.reference_model else "reward"),
        "device": args.device,
        "dtype": args.dtype,
        "attention_backend": args.attention_backend,
        "max_batch_tokens": args.max_batch_tokens,
        "packing": args.packing,
        "reward_index": args.reward_index,
    }
    names = {f.name for f in dataclasses.fields(ExecutorConfig)}
    config = ExecutorConfig(**{k: v for k, v in wanted.items() if k in names})
    return StatelessExecutor.from_pretrained(
        config,
        reference_model=args.reference_model,
        reward_model=args.reward_model,
        gguf_file=args.gguf_file,
        reward_gguf_file=args.reward_gguf_file,
        trust_remote_code=args.trust_remote_code,
        reward_adapter=reward_adapter_from_args(args) if args.reward_model else None,
        weights=weights_config(args),
        reward_head=args.reward_head,
    )


def reward_adapter_from_args(args: argparse.Namespace) -> Any:
    """The reward adapter named by ``--reward-adapter module:factory`` (called with
    ``token_level=``), or the default sequence-classification adapter."""
    token_level = bool(getattr(args, "reward_token_scores", False))
    spec = getattr(args, "reward_adapter", None)
    if not spec:
        from worker.executor.rewards.pooling import SequenceClassificationAdapter

        return SequenceClassificationAdapter(
            token_level=token_level,
            reward_index=args.reward_index,
            reward_weights=getattr(args, "reward_weights", None),
        )
    if getattr(args, "reward_weights", None) is not None:
        raise ConfigError(
            "--reward-weights applies to the checkpoint's own head, not --reward-adapter"
        )
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--reward-adapter must be 'module:factory', got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--reward-adapter {spec!r} cannot be loaded: {exc}") from exc
    adapter = factory(token_level=token_level)
    if not callable(adapter) or not hasattr(adapter, "token_level"):
        raise ConfigError(f"--reward-adapter {spec!r} did not return a RewardAdapter")
    return adapter


def build_info(scorer: Scorer) -> dict[str, Any]:
    """Version, model, dtype, device and library versions for ``scoring_build_info``."""
    from worker import __version__

    info = scorer.info
    out: dict[str, Any] = {"version": __version__}
    for k in ("model", "reward_model", "dtype", "device", "attention_backend", "lm_head"):
        out[k] = info.get(k)
    for lib in ("torch", "transformers"):  # read from package metadata: no import of torch
        try:
            out[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            out[lib] = None
    return out


def run(args: argparse.Namespace) -> int:
    """Load the model once, then serve until drained/stopped."""
    if wants_fleet(args):
        return run_fleet(args, flag_defaults())
    from worker.daemon import Worker
    from worker.observability.health import HealthServer, HealthState
    from worker.observability.metrics import WorkerMetrics

    config = worker_config(args)
    client_name = f"scoring-worker:{config.consumer}"[:100].replace(" ", "_")
    settings = redis_settings(args, client_name=client_name)
    metrics = WorkerMetrics()
    health = HealthState()
    http = None
    if config.metrics_port is not None:
        # Up before the model loads: /healthz answers 200 and /readyz 503 while loading.
        http = HealthServer(
            metrics.registry, health, host=config.metrics_host, port=config.metrics_port
        ).start()
        log.info("metrics on http://%s:%d/metrics", http.host, http.port)
    scorer = build_scorer(args)
    metrics.set_build_info(build_info(scorer))
    worker = Worker(config, settings, scorer, metrics=metrics, health=health)
    worker.http = http
    worker.install_signal_handlers()
    return worker.run()
