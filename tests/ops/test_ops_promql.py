"""The PromQL reference extractor of ``tests/support/ops.py`` catches a drifted metric name or
label (a checker that cannot fail is worthless)."""

from __future__ import annotations

import pytest

from tests.support.ops import problems, promql_refs, series_catalog, substitute_grafana


def test_extracts_names_matchers_and_grouping_labels() -> None:
    refs = promql_refs(
        "histogram_quantile(0.99, sum by (le, instance) (rate(scoring_forward_seconds_bucket"
        '{instance=~".*", job!="x"}[5m]))) / on(instance) group_left scoring_worker_up'
    )
    assert refs.metrics == {
        "scoring_forward_seconds_bucket": {"instance", "job"},
        "scoring_worker_up": set(),
    }
    assert refs.grouping == {"le", "instance"}


def test_ignores_strings_functions_keywords_numbers_and_durations() -> None:
    refs = promql_refs(
        'sum(rate(scoring_jobs_total{outcome="a{b} c_total"}[1m] offset 5m)) > bool 1e-9 '
        "or vector(0) and time() - 3"
    )
    assert set(refs.metrics) == {"scoring_jobs_total"}


def test_grafana_substitution() -> None:
    expr = 'rate(x{instance=~"$instance", s=~"${stream}"}[$__rate_interval])'
    assert substitute_grafana(expr, window="30s") == 'rate(x{instance=~".*", s=~".*"}[30s])'


def test_catalog_maps_suffixes_to_families() -> None:
    cat = series_catalog()
    assert cat["scoring_jobs_total"] == ("scoring_jobs", frozenset({"outcome"}))
    assert cat["scoring_forward_seconds_bucket"][1] == frozenset({"le"})
    assert cat["scoring_forward_seconds_sum"][0] == "scoring_forward_seconds"
    assert "scoring_build_info" in cat
    assert "scoring_jobs" not in cat  # a counter is only ever exported with _total
    assert cat["scoring_stream_lag"][1] == frozenset({"stream", "group"})


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("rate(scoring_jobz_total[5m])", "unknown metric 'scoring_jobz_total'"),
        ("scoring_jobs", "unknown metric 'scoring_jobs'"),
        ('scoring_jobs_total{outcme="ok"}', "scoring_jobs_total has no label 'outcme'"),
        ("sum by (reason) (scoring_jobs_total)", "grouping label 'reason'"),
        ("scoring_batches_total_bucket", "unknown metric"),
        ('scoring_forward_seconds_sum{le="1"}', "has no label 'le'"),
    ],
)
def test_drifted_names_and_labels_are_reported(expr: str, expected: str) -> None:
    found = problems(expr, series_catalog())
    assert found and expected in found[0], found


def test_valid_expressions_have_no_problems() -> None:
    cat = series_catalog()
    for expr in (
        'sum by (outcome) (rate(scoring_jobs_total{outcome!="ok", instance=~".*"}[5m]))',
        "max by (stream) (scoring_stream_lag) > 100",
        'up{job="scoring-worker"} == 0',
        "histogram_quantile(0.5, sum by (le) (rate(scoring_end_to_end_seconds_bucket[1m])))",
    ):
        assert problems(expr, cat) == [], expr
