"""WorkerMetrics: every recording helper moves the samples it names, on a fresh registry."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from worker.observability.metrics import (
    BYTES_BUCKETS,
    JOB_OUTCOMES,
    OUTPUT_KINDS,
    SECONDS_BUCKETS,
    WorkerMetrics,
)
from worker.request import OUTPUT_NAMES


@pytest.fixture
def m() -> WorkerMetrics:
    return WorkerMetrics(CollectorRegistry())


def _v(m: WorkerMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def _batch(m: WorkerMetrics, **over: object) -> None:
    kwargs: dict[str, object] = {
        "batch_size": 3,
        "real_tokens": 120,
        "scored_tokens": 40,
        "padded_tokens": 8,
        "forward_s": 0.02,
        "elapsed_s": 0.03,
        "peak_allocated_bytes": 3 * 2**20,
        "peak_reserved_bytes": 5 * 2**20,
    }
    kwargs.update(over)
    m.record_batch(**kwargs)  # type: ignore[arg-type]


def test_output_kinds_are_the_request_output_names() -> None:
    """The ``output`` label's values (observability imports no request types) are exactly the
    outputs a job may ask for."""
    assert OUTPUT_KINDS == OUTPUT_NAMES


def test_fresh_registries_are_independent() -> None:
    a, b = WorkerMetrics(CollectorRegistry()), WorkerMetrics(CollectorRegistry())
    a.record_job("ok")
    assert _v(a, "scoring_jobs_total", outcome="ok") == 1.0
    assert _v(b, "scoring_jobs_total", outcome="ok") == 0.0


def test_every_job_outcome_is_exported_at_zero_before_any_job(m: WorkerMetrics) -> None:
    for outcome in JOB_OUTCOMES:
        assert _v(m, "scoring_jobs_total", outcome=outcome) == 0.0


def test_record_job_counts_by_outcome_and_maps_unknown_to_internal(m: WorkerMetrics) -> None:
    m.record_job("ok")
    m.record_job("ok")
    m.record_job("bad_request")
    m.record_job("no_such_code")
    assert _v(m, "scoring_jobs_total", outcome="ok") == 2.0
    assert _v(m, "scoring_jobs_total", outcome="bad_request") == 1.0
    assert _v(m, "scoring_jobs_total", outcome="internal") == 1.0
    assert _v(m, "scoring_jobs_total", outcome="no_such_code") is None


def test_record_batch_moves_counters_histograms_and_gauges(m: WorkerMetrics) -> None:
    _batch(m)
    _batch(m, batch_size=1, real_tokens=10, scored_tokens=5, padded_tokens=0, now_s=1234.5,
           packed_fill_tokens=6)  # fmt: skip
    assert _v(m, "scoring_batches_total") == 2.0
    assert _v(m, "scoring_packed_fill_tokens_total") == 6.0
    assert _v(m, "scoring_sequences_total") == 4.0
    assert _v(m, "scoring_tokens_total") == 130.0
    assert _v(m, "scoring_scored_tokens_total") == 45.0
    assert _v(m, "scoring_padded_tokens_total") == 8.0
    assert _v(m, "scoring_batch_size_sequences_count") == 2.0
    assert _v(m, "scoring_batch_size_sequences_sum") == 4.0
    assert _v(m, "scoring_batch_tokens_sum") == 130.0
    assert _v(m, "scoring_forward_seconds_count") == 2.0
    assert _v(m, "scoring_forward_seconds_sum") == pytest.approx(0.04)
    assert _v(m, "scoring_batch_seconds_sum") == pytest.approx(0.06)
    # 0.02 s lands in the 0.025 bucket, not the 0.01 one
    assert _v(m, "scoring_forward_seconds_bucket", le="0.01") == 0.0
    assert _v(m, "scoring_forward_seconds_bucket", le="0.025") == 2.0
    assert _v(m, "scoring_batch_peak_allocated_bytes_count") == 2.0
    assert _v(m, "scoring_last_batch_peak_allocated_bytes") == 3 * 2**20
    assert _v(m, "scoring_last_batch_peak_reserved_bytes") == 5 * 2**20
    assert _v(m, "scoring_last_batch_timestamp_seconds") == 1234.5
    # nothing optional was reported
    assert _v(m, "scoring_kv_outputs_rejected_total") == 0.0
    assert _v(m, "scoring_kv_output_bytes_total") == 0.0
    assert _v(m, "scoring_oom_splits_total") == 0.0
    assert _v(m, "scoring_device_memory_total_bytes") == 0.0


def test_record_batch_counts_kv_rejections_bytes_oom_splits_and_device_total(
    m: WorkerMetrics,
) -> None:
    _batch(m, kv_output_bytes=4096, kv_rejected=True, oom_splits=2, device_total_bytes=80 * 2**30)
    _batch(m, kv_output_bytes=1024, kv_rejected=True)
    assert _v(m, "scoring_kv_outputs_rejected_total") == 2.0
    assert _v(m, "scoring_kv_output_bytes_total") == 5120.0
    assert _v(m, "scoring_oom_splits_total") == 2.0
    assert _v(m, "scoring_device_memory_total_bytes") == 80 * 2**30


def test_fallbacks_are_labelled_by_requested_used_reason(m: WorkerMetrics) -> None:
    m.record_fallback("flash_attention_2", "sdpa", "unavailable")
    m.record_fallback("flash_attention_2", "sdpa", "unavailable")
    m.record_fallback("sdpa", "eager", "runtime_error")
    assert (
        _v(
            m,
            "scoring_attention_fallbacks_total",
            requested="flash_attention_2",
            used="sdpa",
            reason="unavailable",
        )
        == 2.0
    )
    assert (
        _v(
            m,
            "scoring_attention_fallbacks_total",
            requested="sdpa",
            used="eager",
            reason="runtime_error",
        )
        == 1.0
    )


def test_set_backend_keeps_exactly_one_active(m: WorkerMetrics) -> None:
    m.set_backend("flash_attention_2")
    m.set_backend("sdpa")
    assert _v(m, "scoring_attention_backend_active", backend="sdpa") == 1.0
    assert _v(m, "scoring_attention_backend_active", backend="flash_attention_2") == 0.0
    m.set_backend("flash_attention_2")
    assert _v(m, "scoring_attention_backend_active", backend="sdpa") == 0.0
    assert _v(m, "scoring_attention_backend_active", backend="flash_attention_2") == 1.0


def test_build_info_stringifies_values_and_adds_python(m: WorkerMetrics) -> None:
    m.set_build_info({"version": "0.1.0", "model": "/m", "dtype": "float32", "device": None})
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(m.registry).decode())
    }
    (sample,) = families["scoring_build_info"].samples  # Info is a gauge in the text format
    assert sample.name == "scoring_build_info"
    assert sample.value == 1.0
    assert sample.labels["version"] == "0.1.0"
    assert sample.labels["device"] == ""
    assert sample.labels["python"].count(".") == 2


def test_buckets_span_milliseconds_to_minutes_and_mib_to_hundreds_of_gib() -> None:
    assert SECONDS_BUCKETS[0] <= 0.001
    assert SECONDS_BUCKETS[-1] >= 300
    assert list(SECONDS_BUCKETS) == sorted(SECONDS_BUCKETS)
    assert BYTES_BUCKETS[0] == 2**20
    assert BYTES_BUCKETS[-1] >= 141 * 2**30  # an H200 fits under the last bucket


def test_end_to_end_latency_above_ten_seconds_is_not_lumped_into_inf(m: WorkerMetrics) -> None:
    m.end_to_end_seconds.observe(45.0)
    assert _v(m, "scoring_end_to_end_seconds_bucket", le="30.0") == 0.0
    assert _v(m, "scoring_end_to_end_seconds_bucket", le="60.0") == 1.0


def test_stream_gauges_take_stream_and_group_labels(m: WorkerMetrics) -> None:
    m.stream_lag.labels(stream="scoring:{q:0}:jobs", group="scoring").set(7)
    m.stream_pending.labels(stream="scoring:{q:0}:jobs", group="scoring").set(2)
    m.dead_letter_length.labels(stream="scoring:{q:0}:dead").set(1)
    assert _v(m, "scoring_stream_lag", stream="scoring:{q:0}:jobs", group="scoring") == 7.0
    assert _v(m, "scoring_stream_pending", stream="scoring:{q:0}:jobs", group="scoring") == 2.0
    assert _v(m, "scoring_dead_letter_length", stream="scoring:{q:0}:dead") == 1.0


def test_every_metric_follows_naming_conventions(m: WorkerMetrics) -> None:
    text = generate_latest(m.registry).decode()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M))
    assert len(types) > 30
    for name, kind in types.items():
        assert name.startswith("scoring_"), name
        if kind == "counter":
            assert name.endswith("_total"), name
        if ("seconds" in name or "bytes" in name) and not name.endswith("_created"):
            assert re.search(r"_(seconds|bytes)(_total)?$", name), f"unit not last: {name}"
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for label in sample.labels:
                assert label not in ("job_id", "id"), f"{family.name} has a high-cardinality label"


def test_state_gauges_start_at_zero_and_model_loaded_is_exported(m: WorkerMetrics) -> None:
    for name in (
        "scoring_worker_up",
        "scoring_worker_ready",
        "scoring_model_loaded",
        "scoring_worker_draining",
    ):
        assert _v(m, name) == 0.0, name
    m.model_loaded.set(1)  # settable by hand until bind_health() ties it to a HealthState
    assert _v(m, "scoring_model_loaded") == 1.0


def test_bind_health_ties_ready_and_model_loaded_to_the_health_state(m: WorkerMetrics) -> None:
    from worker.observability.health import HealthState

    state = HealthState()
    m.ready.set(1)
    m.bind_health(state)
    assert _v(m, "scoring_worker_ready") == 0.0  # the state, not the value set before
    state.model_ready = state.started = state.redis_ok = True
    assert (_v(m, "scoring_worker_ready"), _v(m, "scoring_model_loaded")) == (1.0, 1.0)
    state.redis_ok = False
    assert _v(m, "scoring_worker_ready") == 0.0
    m.ready.set(1)  # ignored after binding (prometheus-client set_function semantics)
    assert _v(m, "scoring_worker_ready") == 0.0
