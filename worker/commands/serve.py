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
from typing import Any

from worker.commands._options import parse_queue_specs, redis_settings
from worker.commands._serve_flags import configure, default_consumer
from worker.commands._weights import weights_config
from worker.daemon.config import QueueShare, WorkerConfig, queue_shares
from worker.errors import ConfigError
from worker.processes import tp_group
from worker.processes.fleet import run_fleet, wants_fleet
from worker.protocol import Limits
from worker.scorer import Scorer

log = logging.getLogger(__name__)


def flag_defaults() -> dict[str, Any]:
    """Every serve flag's default (dest -> value), from the same ``SCORING_*`` environment."""
    parser = argparse.ArgumentParser(add_help=False)
    configure(parser)
    return vars(parser.parse_args([]))


def shares_from_args(args: argparse.Namespace) -> tuple[QueueShare, ...]:
    """The weighted queues of ``--queue NAME[:WEIGHT]`` (repeatable) and ``--partitions``;
    none with ``--stream`` (its streams are one queue). ``ConfigError`` for a bad value."""
    specs = parse_queue_specs(args.queue)  # validated even when --stream overrides it
    return () if args.stream else queue_shares(specs, args.partitions)


def streams_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """Job stream keys: ``--stream`` (comma-separated), else from ``--queue``/``--partitions``
    (every partition of every queue, queue by queue)."""
    if args.stream:
        out = tuple(s.strip() for s in args.stream.split(",") if s.strip())
        if not out:
            raise ConfigError("--stream is empty")
        return out
    return tuple(s for q in shares_from_args(args) for s in q.streams)


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The ``WorkerConfig`` for parsed serve args."""
    return WorkerConfig(
        streams=streams_from_args(args),
        queues=shares_from_args(args),
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
        handback=args.handback,
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
        allow_redis_eviction=args.allow_redis_eviction,
        redis_check_interval_s=args.redis_check_interval_s,
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


def check_models(args: argparse.Namespace) -> None:
    """``ConfigError`` at once, before anything loads, when no model is named, or a named one
    is a local path that does not exist or a hub id that cannot be had
    (``worker.executor.weights.source``)."""
    if args.scorer == "noop":
        return
    if not (args.reference_model or args.reward_model):
        raise ConfigError(
            "serve needs --reference-model and/or --reward-model (or --scorer noop)",
            hint="e.g. --reference-model ./models/tiny-llama (scoring-worker demo --save-models "
            "./models writes small checkpoints to try)",
        )
    from worker.executor.weights.source import check_model_source

    for flag, name, gguf in (
        ("--reference-model", args.reference_model, args.gguf_file),
        ("--reward-model", args.reward_model, args.reward_gguf_file),
    ):
        if name:
            check_model_source(name, flag=flag, gguf_file=gguf)
    if args.reward_adapter and not args.reward_model and args.tensor_parallel > 1:
        raise ConfigError(
            "--reward-adapter without --reward-model (the reference model read through it) is "
            "not served by a tensor-parallel group; name a --reward-model"
        )


def start_http(config: WorkerConfig, metrics: Any, health: Any) -> Any:
    """The metrics and health endpoint, started (``None`` with ``--metrics-port -1``); a port
    already taken is a ``ConfigError`` naming it and the flag."""
    import errno

    from worker.observability.health import HealthServer

    if config.metrics_port is None:
        return None
    try:
        server = HealthServer(
            metrics.registry, health, host=config.metrics_host, port=config.metrics_port
        )
    except OSError as exc:
        where = f"{config.metrics_host}:{config.metrics_port}"
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"--metrics-port {config.metrics_port}: {where} is already in use (another "
                "worker on this host?)",
                hint="give each worker its own --metrics-port (env SCORING_METRICS_PORT), or 0 "
                "for a free one (logged), or -1 for none",
            ) from exc
        raise ConfigError(f"--metrics-host/--metrics-port: cannot listen on {where}: {exc}") from (
            exc
        )
    return server.start()


def executor_config(args: argparse.Namespace) -> Any:
    """The ``ExecutorConfig`` of parsed serve args (models named; torch imported here)."""
    from worker.executor import ExecutorConfig

    both = bool(args.reference_model and (args.reward_model or args.reward_adapter))
    wanted = {
        "mode": "both" if both else ("reference" if args.reference_model else "reward"),
        "device": args.device,
        "dtype": args.dtype,
        "attention_backend": args.attention_backend,
        "max_batch_tokens": args.max_batch_tokens,
        "packing": args.packing,
        "prefix_sharing": args.prefix_sharing,
        "reward_index": args.reward_index,
        "max_image_pixels": args.max_image_pixels,
        "max_images_per_job": args.max_images_per_job,
        "image_threads": args.image_threads,
        "image_sharing": args.image_sharing,
    }
    names = {f.name for f in dataclasses.fields(ExecutorConfig)}
    return ExecutorConfig(**{k: v for k, v in wanted.items() if k in names})


def build_scorer(args: argparse.Namespace, tp_leader: Any = None) -> Scorer:
    """The noop scorer, a loaded ``StatelessExecutor`` (the one place serve imports it), or,
    with ``tp_leader`` (``tp_group.start_leader``), the leader's scorer of a tensor-parallel
    group."""
    if args.scorer == "noop":
        from worker.scorer.noop import NoopScorer

        return NoopScorer(delay_ms=args.noop_delay_ms, us_per_token=args.noop_us_per_token)
    check_models(args)
    if tp_leader is not None:
        from worker.executor.parallel.group import GroupScorer

        tp_leader.scorer = GroupScorer(
            load_tp_executor(args, tp_leader.comm, tp_leader.plans), tp_leader.comm, tp_leader.clock
        )
        return tp_leader.scorer
    from worker.executor import StatelessExecutor

    return StatelessExecutor.from_pretrained(
        executor_config(args),
        reference_model=args.reference_model,
        reward_model=args.reward_model,
        gguf_file=args.gguf_file,
        reward_gguf_file=args.reward_gguf_file,
        trust_remote_code=args.trust_remote_code,
        reward_adapter=reward_adapter_from_args(args)
        if args.reward_model or args.reward_adapter
        else None,
        weights=weights_config(args),
        reward_head=args.reward_head,
    )


def load_tp_executor(args: argparse.Namespace, comm: Any, plans: list[Any]) -> Any:
    """This rank's ``ParallelExecutor`` (every rank of a group builds it alike)."""
    from worker.executor.parallel.executor import ParallelExecutor

    config = dataclasses.replace(executor_config(args), device=comm.spec.device)
    return ParallelExecutor.load(
        config,
        comm,
        plans,
        reference_model=args.reference_model,
        reward_model=args.reward_model,
        trust_remote_code=args.trust_remote_code,
        reward_adapter=reward_adapter_from_args(args) if args.reward_model else None,
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
    out["tensor_parallel"] = info.get("tensor_parallel") or 1  # ranks of the worker's group
    for lib in ("torch", "transformers"):  # read from package metadata: no import of torch
        try:
            out[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            out[lib] = None
    return out


def wants_warmup(args: argparse.Namespace, scorer: Scorer) -> bool:
    """``--warmup``/``--no-warmup`` as given; unset (auto): on when the scorer runs on CUDA."""
    if args.warmup is not None:
        return bool(args.warmup)
    return str(scorer.info.get("device") or "").startswith("cuda")


def import_executor(args: argparse.Namespace) -> None:
    """Import torch, transformers' loading machinery (which transformers imports lazily, on the
    first ``from_pretrained``) and the executor: the ``import`` phase of a cold start, so that
    ``model_read`` is the checkpoint's reading. The no-op scorer needs none of them."""
    if args.scorer == "noop":
        return
    import contextlib
    import importlib

    modules = ["torch", "transformers.modeling_utils", "worker.executor.core"]
    named = (args.reference_model, args.reward_model, args.gguf_file, args.reward_gguf_file)
    if any(str(name or "").lower().endswith(".gguf") for name in named):
        modules += ["transformers.modeling_gguf_pytorch_utils", "gguf"]
    for name in modules:
        with contextlib.suppress(ImportError):  # a missing one fails at load, with its message
            importlib.import_module(name)


def check_redis(settings: Any, config: WorkerConfig) -> Any:
    """The start-up check of what Redis keeps (``worker.connections.check_server``): a
    ``ConfigError`` in one line for a policy that evicts, unless ``--allow-redis-eviction``;
    the states read, or None when Redis cannot be reached yet (the worker checks on connect)."""
    from worker.connections import CONNECT_ERRORS, check_server, connect

    try:
        client = connect(settings)
        try:
            return check_server(client, allow_eviction=config.allow_redis_eviction)
        finally:
            client.close()
    except CONNECT_ERRORS as exc:
        log.warning("cannot read Redis's eviction policy yet (%s): checked on connect", exc)
        return None


def run(args: argparse.Namespace) -> int:
    """Load the model once, then serve until drained/stopped."""
    from worker.observability.startup import StartupClock, process_age_s

    clock = StartupClock()
    clock.add("interpreter", process_age_s())  # the interpreter and the CLI, up to here
    shares_from_args(args)  # a bad --queue fails here (exit 2), before any child starts
    if wants_fleet(args):
        return run_fleet(args, flag_defaults())
    if tp_group.is_follower():  # rank 1..N-1 of a tensor-parallel group
        return tp_group.run_follower(args, lambda comm, plans: load_tp_executor(args, comm, plans))
    from worker.daemon import Worker
    from worker.observability.health import HealthState
    from worker.observability.metrics import WorkerMetrics

    config = worker_config(args)
    client_name = f"scoring-worker:{config.consumer}"[:100].replace(" ", "_")
    settings = redis_settings(args, client_name=client_name)
    check_models(args)  # a typo fails here, in a second, not after the endpoint is up
    if tp_group.tp_size(args) > 1:
        tp_group.check_tp_group(args)  # what the group cannot serve: refused before Redis is read
    redis_states = check_redis(settings, config)  # an evicting Redis: refused before the load
    tp_leader = tp_group.start_leader(args, flag_defaults()) if tp_group.tp_size(args) > 1 else None
    try:
        metrics = WorkerMetrics()
        health = HealthState()
        # Up before the model loads: /healthz answers 200 and /readyz 503 while loading.
        http = start_http(config, metrics, health)
        with clock.phase("import"):
            import_executor(args)
        scorer = build_scorer(args, tp_leader)
        for phase, seconds in getattr(scorer, "startup_seconds", {}).items():
            clock.add(phase, seconds)
        if wants_warmup(args, scorer):
            from worker.scorer.warmup import run_warmup

            clock.add("warmup", run_warmup(scorer, max_batch_tokens=config.max_batch_tokens))
        metrics.set_build_info(build_info(scorer))
        worker = Worker(config, settings, scorer, metrics=metrics, health=health)
        if redis_states is not None:
            worker.server.checked(redis_states)
        worker.http = http
        worker.startup = clock
        worker.install_signal_handlers()
        code = worker.run()
    except BaseException:
        if tp_leader is not None:
            tp_leader.abort()
        raise
    if tp_leader is not None:
        tp_leader.close()  # the leader drained: stop the followers
    return code
