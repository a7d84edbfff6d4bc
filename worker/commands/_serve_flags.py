"""The flags of ``scoring-worker serve``, each with its ``SCORING_*`` variable (a flag on the
command line wins over the environment); ``serve.py`` turns them into a worker."""

from __future__ import annotations

import argparse
import os
import socket

from worker.commands._help import name_env_vars
from worker.commands._options import add_queue_args, add_redis_args
from worker.commands._weights import add_weights_args
from worker.config import env_bool, env_float, env_get
from worker.processes.fleet import add_fleet_args
from worker.protocol import DEFAULT_LIMITS


def _env_int(name: str, default: int | None) -> int | None:
    raw = env_get(name)
    return int(raw) if raw not in (None, "") else default


def _floats(text: str | None) -> tuple[float, ...]:
    """``"1,0.5,-2"`` -> ``(1.0, 0.5, -2.0)``."""
    try:
        return tuple(float(x) for x in (text or "").split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers: {exc}") from exc


def _env_warmup() -> bool | None:
    """``SCORING_WARMUP``: unset or ``auto`` -> None (on for CUDA), else a boolean."""
    raw = env_get("WARMUP")
    if raw in (None, "") or str(raw).strip().lower() == "auto":
        return None
    return env_bool(raw)


def default_consumer() -> str:
    """``POD_NAME`` when set (Kubernetes), else ``<hostname>-<pid>``."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the serve flags (defaults come from ``SCORING_*`` env)."""
    add_redis_args(parser)
    q = add_queue_args(parser, multi=True)
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
    m.add_argument(
        "--reference-model",
        default=env_get("REFERENCE_MODEL"),
        help="the causal LM whose log-probs (and teacher outputs) jobs ask for: a local "
        "checkpoint directory, a .gguf file, or a hub id (read from the local cache offline)",
    )
    m.add_argument(
        "--reward-model",
        default=env_get("REWARD_MODEL"),
        help="the reward model (a *ForSequenceClassification checkpoint, or see --reward-head): "
        "a local directory, a .gguf file, or a hub id",
    )
    m.add_argument(
        "--gguf-file",
        default=env_get("GGUF_FILE"),
        help="the .gguf file inside --reference-model's directory (or give the file's own path "
        "as --reference-model)",
    )
    m.add_argument(
        "--reward-gguf-file",
        default=env_get("REWARD_GGUF_FILE"),
        help="the .gguf file inside --reward-model's directory",
    )
    m.add_argument(
        "--reward-adapter",
        default=env_get("REWARD_ADAPTER"),
        help="'module:factory' returning a RewardAdapter for a non-standard reward head (imports "
        "and runs that code); default: the *ForSequenceClassification head (num_labels=1). "
        "Without --reward-model it reads the reference model (e.g. a value head on a "
        "vision-language model): one model serves both modes, a `both` job in one forward",
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
    m.add_argument(
        "--device",
        default=env_get("DEVICE", "auto"),
        help="auto (CUDA when available, else CPU), cpu, cuda or cuda:N",
    )
    m.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float16", "float32"],
        default=env_get("DTYPE", "auto"),
        help="weights and activations: auto = bfloat16 on CUDA (float16 without bf16 support), "
        "float32 on CPU; bfloat16 is also fast on CPUs with AMX (log-probs stay float32)",
    )
    m.add_argument(
        "--attention-backend",
        choices=["auto", "flash_attention_2", "flex_attention", "sdpa", "eager"],
        default=env_get("ATTENTION_BACKEND", "auto"),
        help="first backend of the fallback chain flash_attention_2 -> sdpa -> eager (auto: "
        "flash_attention_2 where it imports and runs; flex_attention: flex_attention -> sdpa "
        "-> eager); a batch that fails in one retries on the next",
    )
    m.add_argument(
        "--packing",
        choices=["auto", "packed", "unmasked", "padded"],
        default=env_get("PACKING", "auto"),
        help="batch layout (executor): auto = per attention backend, packed rows, unmasked "
        "(mask-free right-padded) buckets, or padded buckets with a mask",
    )
    m.add_argument(
        "--prefix-sharing",
        choices=["auto", "off"],
        default=env_get("PREFIX_SHARING", "auto"),
        help="compute a prefix shared by several sequences of a batch once, in one forward "
        "(auto: where the load check finds the tree rows exact; off: every sequence alone)",
    )
    m.add_argument(
        "--max-image-pixels",
        type=int,
        default=_env_int("MAX_IMAGE_PIXELS", 4096 * 4096),
        help="vision-language models: the largest image a job may send, width x height in "
        "pixels, checked from the file's header before it is decoded",
    )
    m.add_argument(
        "--max-images-per-job",
        type=int,
        default=_env_int("MAX_IMAGES_PER_JOB", 64),
        help="vision-language models: the most images one job may send",
    )
    m.add_argument(
        "--image-threads",
        type=int,
        default=_env_int("IMAGE_THREADS", 4),
        help="vision-language models: how many of a job's distinct images are decoded and "
        "processed at once, on threads beside the forward (1: one at a time)",
    )
    m.add_argument(
        "--image-sharing",
        choices=["on", "off"],
        default=env_get("IMAGE_SHARING", "on"),
        help="vision-language models: run the vision tower once per distinct image of a batch "
        "(on), or once per image of every sequence (off: each sequence's images alone, as a "
        "reference to compare with)",
    )
    m.add_argument(
        "--trust-remote-code",
        action="store_true",
        default=env_bool(env_get("TRUST_REMOTE_CODE")),
        help="run the checkpoint's own modelling code (custom architectures); it executes code "
        "shipped with the checkpoint",
    )
    m.add_argument(
        "--noop-delay-ms",
        type=float,
        default=env_float("NOOP_DELAY_MS", 0.0),
        help="noop scorer only: sleep this long per batch",
    )
    m.add_argument(
        "--noop-us-per-token",
        type=float,
        default=env_float("NOOP_US_PER_TOKEN", 0.0),
        help="noop scorer only: also sleep this many microseconds per token of the batch (a "
        "fixed per-token cost, for replaying traces against the autoscaling simulation)",
    )
    add_weights_args(parser)  # per-job adapters and versions
    t = parser.add_argument_group("tensor parallelism (one model over several devices)")
    t.add_argument(
        "--tensor-parallel",
        type=int,
        default=_env_int("TENSOR_PARALLEL", 1),
        help="run this worker as a group of N processes, one per device, holding one model "
        "sharded with transformers' tensor parallelism; rank 0 alone talks to Redis. With "
        "--gpus all, one group per N GPUs; on CPU (--device cpu) the ranks talk over gloo",
    )
    t.add_argument(
        "--tensor-parallel-timeout-s",
        type=float,
        default=env_float("TENSOR_PARALLEL_TIMEOUT_S", 300.0),
        help="a rank that spends longer than this in one batch (a hung kernel, a collective a "
        "stopped peer never joins) takes its group down; its batch is reclaimed",
    )
    b = parser.add_argument_group("batching and delivery")
    b.add_argument(
        "--max-batch-tokens",
        type=int,
        default=_env_int("MAX_BATCH_TOKENS", 16384),
        help="token budget of one forward (real tokens summed over its sequences); larger "
        "jobs are split over forwards, a sequence longer than it runs alone",
    )
    b.add_argument(
        "--max-wait-ms",
        type=int,
        default=_env_int("MAX_WAIT_MS", 5),
        help="how long to wait for more jobs to fill a batch",
    )
    b.add_argument(
        "--block-ms",
        type=int,
        default=_env_int("BLOCK_MS", 1000),
        help="how long one blocking read waits for new jobs before the loop looks again",
    )
    b.add_argument(
        "--claim-idle-ms",
        type=int,
        default=_env_int("CLAIM_IDLE_MS", 30000),
        help="entries idle this long (their worker died) are reclaimed",
    )
    b.add_argument(
        "--max-deliveries",
        type=int,
        default=_env_int("MAX_DELIVERIES", 5),
        help="an entry delivered more often goes to the dead-letter stream and its producer "
        "gets a dead_letter error",
    )
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
    b.add_argument(
        "--durable-timeout-ms",
        type=int,
        default=_env_int("DURABLE_TIMEOUT_MS", 1000),
        help="how long the WAIT of --durable-replicas waits for the replicas",
    )
    b.add_argument(
        "--durable-all-results",
        action="store_true",
        default=env_bool(env_get("DURABLE_ALL_RESULTS")),
        help="with --durable-replicas, WAIT after the atomic result + ack script too",
    )
    b.add_argument(
        "--drain-timeout-s",
        type=float,
        default=env_float("DRAIN_TIMEOUT_S", 60.0),
        help="on SIGTERM, how long the worker may take to finish its in-flight batch and write "
        "the results before it exits",
    )
    b.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=_env_warmup(),
        help="before turning ready, score one batch at --max-batch-tokens so the first real "
        "batch does not pay for the allocator's growth (default: auto, on for CUDA devices, "
        "off on CPU; env SCORING_WARMUP=1/0/auto)",
    )
    b.add_argument(
        "--no-handback",
        dest="handback",
        action="store_false",
        default=env_bool(env_get("HANDBACK"), default=True),
        help="on SIGTERM, finish the whole read-ahead backlog instead of handing the jobs read "
        "but not started back to the group for another worker (env SCORING_HANDBACK=0; "
        "default: hand back, finish only the computing batch)",
    )
    b.add_argument(
        "--batch-timeout-s",
        type=float,
        default=env_float("BATCH_TIMEOUT_S", 1800.0),
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
    b.add_argument(
        "--max-jobs",
        type=int,
        default=_env_int("MAX_JOBS", None),
        help="exit after answering this many jobs (tests, batch runs)",
    )
    b.add_argument(
        "--no-pipeline",
        dest="pipeline",
        action="store_false",
        default=env_bool(env_get("PIPELINE"), default=True),
        help="score each batch in the main loop instead of on a compute thread that overlaps "
        "Redis reads and writes (env SCORING_PIPELINE=0; for comparison)",
    )
    r = parser.add_argument_group("what Redis keeps (docs/operations.md)")
    r.add_argument(
        "--allow-redis-eviction",
        action="store_true",
        default=env_bool(env_get("ALLOW_REDIS_EVICTION")),
        help="serve even when Redis's maxmemory-policy is not noeviction (it may then delete "
        "jobs and results under memory pressure); logged, and 1 in scoring_redis_evicting",
    )
    r.add_argument(
        "--redis-check-interval-s",
        type=float,
        default=env_float("REDIS_CHECK_INTERVAL_S", 60.0),
        help="seconds between reads of Redis's eviction policy, persistence and memory "
        "(default 60)",
    )
    o = parser.add_argument_group("metrics")
    o.add_argument(
        "--metrics-host",
        default=env_get("METRICS_HOST", "127.0.0.1"),
        help="address of /metrics, /healthz and /readyz (0.0.0.0 lets Prometheus scrape it "
        "from another host)",
    )
    o.add_argument(
        "--metrics-port",
        type=int,
        default=_env_int("METRICS_PORT", 9400),
        help="0 = a free port (logged); -1 = no HTTP endpoint",
    )
    add_fleet_args(parser)  # --replicas/--gpus and the restart policy of their supervisor
    name_env_vars(parser)  # every serve flag has its SCORING_* variable
