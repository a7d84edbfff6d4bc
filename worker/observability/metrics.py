"""Prometheus metrics of a worker, built in one object from an injectable registry.

Plain numbers in (never tensors: no torch here). Names: ``scoring_`` prefix, base units,
``_total`` on counters. Dashboards (``ops/grafana``) and alert rules (``ops/prometheus``) refer
to these names; ``tests/ops/`` fail when one drifts."""

from __future__ import annotations

import platform
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from worker.errors import ERROR_CODES
from worker.observability.image_metrics import ImageMetrics
from worker.observability.queue_metrics import QueueMetrics
from worker.observability.redis_metrics import RedisServerMetrics

if TYPE_CHECKING:
    from worker.observability.health import HealthState

# Buckets sized for GPU batches: milliseconds to minutes.
SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
BYTES_BUCKETS = tuple(float(2**p) for p in range(20, 39, 1))  # 1 MiB .. 256 GiB
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BATCH_TOKENS_BUCKETS = tuple(float(2**p) for p in range(6, 21))  # 64 .. 1M tokens

JOB_OUTCOMES: tuple[str, ...] = ("ok", *ERROR_CODES)  # the table in worker.errors
#: Per-token outputs a job may ask for (``worker.request.OUTPUT_NAMES``; a test checks).
OUTPUT_KINDS = ("logps", "entropy", "topk", "gather", "processed_logps", "rank", "hidden")
RESULT_BYTES_BUCKETS = tuple(float(2**p) for p in range(10, 31, 2))  # 1 KiB .. 1 GiB


# The metric definitions: a declarative table (one constructor call per exported metric, with its
# name, help and labels), followed by a few recording helpers; its length is the catalogue's.
class WorkerMetrics(QueueMetrics, RedisServerMetrics, ImageMetrics):
    """Every metric a worker exports. Pass a fresh ``CollectorRegistry`` in tests."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # --- jobs and tokens
        self.jobs = Counter(
            "scoring_jobs_total",
            "Jobs finished, by outcome (ok or error code).",
            ["outcome"],
            registry=r,
        )
        for outcome in JOB_OUTCOMES:
            self.jobs.labels(outcome=outcome)
        self.sequences = Counter("scoring_sequences_total", "Sequences scored.", registry=r)
        self.tokens = Counter(
            "scoring_tokens_total", "Real (non-padding) tokens run through the model.", registry=r
        )
        self.scored_tokens = Counter(
            "scoring_scored_tokens_total", "Tokens whose log-prob was returned.", registry=r
        )
        self.padded_tokens = Counter(
            "scoring_padded_tokens_total",
            "Padding tokens of padded buckets (0 when packed).",
            registry=r,
        )
        self.packed_fill_tokens = Counter(
            "scoring_packed_fill_tokens_total",
            "Pad tails that even out the packed rows of one forward (sdpa/eager).",
            registry=r,
        )
        self.forward_tokens = Counter(
            "scoring_forward_tokens_total", "Backbone tokens (a shared prefix once).", registry=r
        )
        self.shared_prefix_tokens = Counter(
            "scoring_shared_prefix_tokens_total", "Prefix tokens shared by tree rows.", registry=r
        )
        self.batches = Counter("scoring_batches_total", "Forward batches run.", registry=r)
        # --- teacher outputs (distillation)
        self.outputs_requested = Counter(
            "scoring_outputs_requested_total",
            "Jobs accepted that ask for each per-token output (logps, entropy, topk, ...).",
            ["output"],
            registry=r,
        )
        for output in OUTPUT_KINDS:
            self.outputs_requested.labels(output=output)
        self.result_bytes = Histogram(
            "scoring_result_bytes",
            "Bytes of the per-token arrays (logps and teacher outputs) of each ok result.",
            buckets=RESULT_BYTES_BUCKETS,
            registry=r,
        )
        # --- reward inputs (chat templates) and process rewards
        self.tokenization_seconds = Histogram(
            "scoring_tokenization_seconds",
            "Time to render a job's messages with the reward model's chat template (intake).",
            buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=r,
        )
        self.step_scores = Counter(
            "scoring_step_scores_total", "Process-reward step scores returned.", registry=r
        )
        self.batch_size = Histogram(
            "scoring_batch_size_sequences",
            "Sequences per batch.",
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.batch_tokens = Histogram(
            "scoring_batch_tokens",
            "Real tokens per batch.",
            buckets=BATCH_TOKENS_BUCKETS,
            registry=r,
        )
        # --- latency
        self.forward_seconds = Histogram(
            "scoring_forward_seconds",
            "Model forward time per batch.",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.batch_seconds = Histogram(
            "scoring_batch_seconds",
            "Executor time per batch (forward plus log-prob/reward math).",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "scoring_queue_wait_seconds",
            "Time from enqueue to the worker reading the job.",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.end_to_end_seconds = Histogram(
            "scoring_end_to_end_seconds",
            "Time from enqueue to the result being written.",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        # --- memory
        self.peak_allocated = Histogram(
            "scoring_batch_peak_allocated_bytes",
            "Peak allocated device memory per batch (process RSS peak on CPU).",
            buckets=BYTES_BUCKETS,
            registry=r,
        )
        self.peak_reserved = Histogram(
            "scoring_batch_peak_reserved_bytes",
            "Peak reserved device memory per batch (process RSS peak on CPU).",
            buckets=BYTES_BUCKETS,
            registry=r,
        )
        self.last_peak_allocated = Gauge(
            "scoring_last_batch_peak_allocated_bytes",
            "Peak allocated memory of the last batch.",
            registry=r,
        )
        self.last_peak_reserved = Gauge(
            "scoring_last_batch_peak_reserved_bytes",
            "Peak reserved memory of the last batch.",
            registry=r,
        )
        self.device_total = Gauge(
            "scoring_device_memory_total_bytes",
            "Total memory of the device (host RAM on CPU).",
            registry=r,
        )
        self.oom_splits = Counter(
            "scoring_oom_splits_total",
            "Batches split in halves after an out-of-memory error.",
            registry=r,
        )
        # --- attention backends and KV cache
        self.fallbacks = Counter(
            "scoring_attention_fallbacks_total",
            "Attention backend fallbacks.",
            ["requested", "used", "reason"],
            registry=r,
        )
        self.active_backend = Gauge(
            "scoring_attention_backend_active",
            "1 for the attention backend in use.",
            ["backend"],
            registry=r,
        )
        self.kv_rejected = Counter(
            "scoring_kv_outputs_rejected_total",
            "Batches whose model returned a KV cache despite use_cache=False.",
            registry=r,
        )
        self.kv_bytes = Counter(
            "scoring_kv_output_bytes_total",
            "Bytes of KV-cache tensors returned by the model (should stay 0).",
            registry=r,
        )
        # --- delivery
        self.leases_renewed = Counter(
            "scoring_leases_renewed_total",
            "In-flight entries whose lease was renewed (XCLAIM JUSTID).",
            registry=r,
        )
        self.reclaimed = Counter(
            "scoring_entries_reclaimed_total",
            "Entries taken over from dead consumers (XAUTOCLAIM).",
            registry=r,
        )
        self.handed_back = Counter("scoring_entries_handed_back_total", "Entries read, not "
                                   "started, handed back on drain.", registry=r)  # fmt: skip
        self.dead_lettered = Counter(
            "scoring_dead_lettered_total",
            "Entries moved to the dead-letter stream.",
            ["reason"],
            registry=r,
        )
        self.superseded = Counter(
            "scoring_results_superseded_total",
            "Results not written because another consumer had taken the entry over.",
            registry=r,
        )
        # durable result writes (--durable-replicas)
        self.durable_shortfalls = Counter(
            "scoring_durable_shortfalls_total",
            "WAITs after result writes that fewer replicas than asked acknowledged in time "
            "(write: two_step, the entries stay unacked and are written again; one_script, "
            "already acked).",
            ["write"],
            registry=r,
        )
        self.redelivered = Counter(
            "scoring_entries_redelivered_total", "Entries delivered more than once.", registry=r
        )
        self.redis_reconnects = Counter(
            "scoring_redis_reconnects_total",
            "Redis connection failures recovered from.",
            registry=r,
        )
        self.loop_errors = Counter(
            "scoring_loop_errors_total",
            "Unexpected errors caught by the worker loop.",
            ["where"],
            registry=r,
        )
        # --- stream gauges (sampled by the worker so no extra exporter is needed)
        self.stream_length = Gauge(
            "scoring_stream_length", "Entries in the job stream.", ["stream"], registry=r
        )
        self.stream_lag = Gauge(
            "scoring_stream_lag",
            "Entries not yet delivered to the group.",
            ["stream", "group"],
            registry=r,
        )
        self.stream_pending = Gauge(
            "scoring_stream_pending",
            "Entries delivered but not acked.",
            ["stream", "group"],
            registry=r,
        )
        self.stream_consumers = Gauge(
            "scoring_stream_consumers", "Consumers in the group.", ["stream", "group"], registry=r
        )
        self.dead_letter_length = Gauge(
            "scoring_dead_letter_length",
            "Entries in the dead-letter stream.",
            ["stream"],
            registry=r,
        )
        self.in_flight = Gauge(
            "scoring_in_flight_jobs", "Jobs this worker holds right now.", registry=r
        )
        self.build_queue_metrics(r)  # per queue (serve --queue a:3 --queue b:1)
        self.build_redis_metrics(r)  # what Redis keeps (worker.connections.ServerWatch)
        self.build_image_metrics(r)  # vision-language models' images
        # --- per-job weights (adapters, versions): docs/models.md
        self.weights_loads = Counter(
            "scoring_weights_loads_total",
            "Adapter/version loads, by kind, reason (miss, evict, preload) and outcome.",
            ["kind", "reason", "outcome"],
            registry=r,
        )
        self.weights_load_seconds = Histogram(
            "scoring_weights_load_seconds", "Time to load one adapter/version.", ["kind"],
            buckets=SECONDS_BUCKETS, registry=r,
        )  # fmt: skip
        self.weights_evictions = Counter(
            "scoring_weights_evictions_total", "Adapters/versions evicted (LRU).", registry=r
        )
        self.weights_resident = Gauge(
            "scoring_weights_resident", "Adapters/versions resident now.", ["kind"], registry=r
        )
        self.weights_resident_bytes = Gauge(
            "scoring_weights_resident_bytes", "Bytes of resident adapters/versions.", registry=r
        )
        self.weights_jobs = Counter(
            "scoring_weights_jobs_total",
            "Jobs naming an adapter/version, by whether it was resident (hit) or loaded (miss).",
            ["result"],
            registry=r,
        )
        # --- tensor-parallel groups (serve --tensor-parallel N): docs/scaling.md
        self.tp_ranks = Gauge(
            "scoring_tp_ranks", "Ranks (devices) of this worker's tensor-parallel group.",
            registry=r,
        )  # fmt: skip
        self.tp_rank_peak = Gauge(
            "scoring_tp_rank_peak_bytes",
            "Peak memory of each rank of the group during the last batch (CUDA peak allocated; "
            "process RSS peak on CPU).",
            ["rank"],
            registry=r,
        )
        self.tp_collective_seconds = Counter(
            "scoring_tp_collective_seconds",
            "Seconds the leader spent in the group's collectives, by kind (broadcast, vote, "
            "head, peaks).",
            ["kind"],
            registry=r,
        )
        # --- state and build info
        self.up = Gauge("scoring_worker_up", "1 while the worker loop runs.", registry=r)
        # ready and model_loaded follow the HealthState once bind_health() has been called.
        self.ready = Gauge("scoring_worker_ready", "1 while /readyz answers 200.", registry=r)
        self.model_loaded = Gauge(
            "scoring_model_loaded",
            "1 once the model is loaded (/startupz answers 200); 0 while it loads.",
            registry=r,
        )
        self.draining = Gauge(
            "scoring_worker_draining", "1 while draining after SIGTERM.", registry=r
        )
        # --- cold start (worker.observability.startup)
        self.startup_phase = Gauge("scoring_startup_phase_seconds", "Duration of each start-up "
                                   "phase.", ["phase"], registry=r)  # fmt: skip
        self.startup = Gauge("scoring_startup_seconds", "Seconds from process start until "
                             "ready / the first result.", ["until"], registry=r)  # fmt: skip
        self.last_batch_timestamp = Gauge(
            "scoring_last_batch_timestamp_seconds",
            "Unix time of the last finished batch.",
            registry=r,
        )
        self.build = Info(
            "scoring_build", "Version, model, dtype, device and library versions.", registry=r
        )

    # ----------------------------------------------------------------- health binding
    def bind_health(self, health: HealthState) -> None:
        """Derive ``scoring_worker_ready`` and ``scoring_model_loaded`` from ``health`` per scrape.

        ``scoring_worker_ready`` is then ``health.readiness()[0]`` (exactly what ``/readyz``
        answers: it drops to 0 while Redis is unreachable, draining, or before the model is
        loaded) and ``scoring_model_loaded`` is ``health.model_ready`` (what ``/startupz``
        answers), with no code path having to remember to set them.

        Uses prometheus-client's ``Gauge.set_function``: after binding, ``set``/``inc``/``dec``
        still run but no longer change what is exported (a leftover ``metrics.ready.set(0)`` is
        dead code: change ``health`` instead). Calling this again rebinds to the new ``health``.
        """

        def ready() -> float:
            return float(health.readiness()[0])

        def model_loaded() -> float:
            return float(bool(health.model_ready))

        self.ready.set_function(ready)
        self.model_loaded.set_function(model_loaded)

    # ----------------------------------------------------------------- recording helpers
    def set_build_info(self, info: Mapping[str, Any]) -> None:
        """Publish build/model info; values are stringified, ``None`` becomes ``""``."""
        base = {"python": platform.python_version()}
        base.update({k: "" if v is None else str(v) for k, v in info.items()})
        self.build.info(base)

    def set_backend(self, backend: str) -> None:
        """Mark ``backend`` as the active attention backend (others go to 0)."""
        for sample in list(self.active_backend._metrics):
            self.active_backend.labels(*sample).set(0)
        self.active_backend.labels(backend=backend).set(1)

    def record_fallback(self, requested: str, used: str, reason: str) -> None:
        """Count one attention fallback; ``reason`` is a short class, never a message."""
        self.fallbacks.labels(requested=requested, used=used, reason=reason).inc()

    def record_batch(
        self,
        *,
        batch_size: int,
        real_tokens: int,
        scored_tokens: int,
        padded_tokens: int,
        packed_fill_tokens: int = 0,
        forward_tokens: int = 0,
        shared_prefix_tokens: int = 0,
        forward_s: float,
        elapsed_s: float,
        peak_allocated_bytes: int,
        peak_reserved_bytes: int,
        kv_output_bytes: int = 0,
        kv_rejected: bool = False,
        oom_splits: int = 0,
        device_total_bytes: int | None = None,
        now_s: float | None = None,
    ) -> None:
        """Record one executor batch (numbers from the executor's ``BatchMetrics``)."""
        self.batches.inc()
        self.sequences.inc(batch_size)
        self.tokens.inc(real_tokens)
        self.scored_tokens.inc(scored_tokens)
        self.padded_tokens.inc(padded_tokens)
        self.packed_fill_tokens.inc(packed_fill_tokens)
        self.forward_tokens.inc(forward_tokens)
        self.shared_prefix_tokens.inc(shared_prefix_tokens)
        self.batch_size.observe(batch_size)
        self.batch_tokens.observe(real_tokens)
        self.forward_seconds.observe(forward_s)
        self.batch_seconds.observe(elapsed_s)
        self.peak_allocated.observe(peak_allocated_bytes)
        self.peak_reserved.observe(peak_reserved_bytes)
        self.last_peak_allocated.set(peak_allocated_bytes)
        self.last_peak_reserved.set(peak_reserved_bytes)
        if kv_output_bytes:
            self.kv_bytes.inc(kv_output_bytes)
        if kv_rejected:
            self.kv_rejected.inc()
        if oom_splits:
            self.oom_splits.inc(oom_splits)
        if device_total_bytes:
            self.device_total.set(device_total_bytes)
        if now_s is not None:
            self.last_batch_timestamp.set(now_s)

    def record_group(
        self, rank_peak_bytes: tuple[int, ...], collective_s: Mapping[str, float]
    ) -> None:
        """Record one batch of a tensor-parallel group (its ``GroupReport`` numbers)."""
        self.tp_ranks.set(len(rank_peak_bytes))
        for rank, peak in enumerate(rank_peak_bytes):
            self.tp_rank_peak.labels(rank=str(rank)).set(peak)
        for kind, seconds in collective_s.items():
            self.tp_collective_seconds.labels(kind=kind).inc(seconds)

    def record_job(self, outcome: str, queue: str | None = None) -> None:
        """Count one finished job by outcome (``ok`` or an error code), and by ``queue``."""
        if outcome not in JOB_OUTCOMES:
            outcome = "internal"
        self.jobs.labels(outcome=outcome).inc()
        if queue is not None:
            self.queue_jobs.labels(queue=queue, outcome=outcome).inc()
