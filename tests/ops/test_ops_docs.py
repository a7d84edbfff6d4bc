"""The operator docs checked against the repository: every file path that the docs, the dashboard,
the alert rules and the KEDA/Kubernetes manifests mention exists; the metric, health-endpoint and
alert tables of docs/operations.md match what the code and ops/ define; docs/scaling.md quotes the
same capacity figures as README.md."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from tests.support.ops import ROOT, alert_rules
from worker.observability.health import HealthServer, HealthState
from worker.observability.metrics import WorkerMetrics

DOCS = ROOT / "docs"
OPERATIONS = DOCS / "operations.md"
SCALING = DOCS / "scaling.md"
README = ROOT / "README.md"
PERFORMANCE = DOCS / "performance.md"
OPS_DOCS = [OPERATIONS, DOCS / "operations-worker.md", SCALING, README]
OPS_FILES = sorted(p for p in (ROOT / "ops").rglob("*") if p.is_file())

# A repository path: a top-level directory of this repo, then path characters; `*` globs allowed.
_PATH = re.compile(r"(?<![\w./-])((?:ops|docs|worker|tests)/[A-Za-z0-9_.*/-]*[A-Za-z0-9_*/])")
_MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _mentioned_paths(text: str) -> set[str]:
    return set(_PATH.findall(text))


def _exists(rel: str) -> bool:
    if "*" in rel:
        return any(ROOT.glob(rel))
    return (ROOT / rel).exists()


# ------------------------------------------------------------------ paths
def test_path_extractor_finds_paths_and_skips_prose() -> None:
    found = _mentioned_paths(
        "see `ops/k8s/deployment.yaml`, ops/prometheus/alerts.yml. and tests/test_client_*.py; "
        "not scoring-worker/ops or a/docs/x, nor http://host/metrics"
    )
    assert found == {
        "ops/k8s/deployment.yaml",
        "ops/prometheus/alerts.yml",
        "tests/test_client_*.py",
    }


@pytest.mark.parametrize("path", OPS_DOCS + OPS_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_mentioned_repository_path_exists(path: Path) -> None:
    missing = sorted(p for p in _mentioned_paths(_text(path)) if not _exists(p))
    assert missing == [], f"{path.relative_to(ROOT)} mentions missing paths"


@pytest.mark.parametrize("path", OPS_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_bare_manifest_names_exist_under_ops(path: Path) -> None:
    """`deployment.yaml`, `keda-scaledobject-prometheus.yaml`... named without their directory."""
    names = set(re.findall(r"`([\w.-]+\.(?:ya?ml|json))`", _text(path)))
    under_ops = {p.name for p in OPS_FILES} | {"docker-compose.yml"}
    assert sorted(names - under_ops) == [], f"{path.relative_to(ROOT)} names missing files"


@pytest.mark.parametrize("path", OPS_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_markdown_links_resolve(path: Path) -> None:
    links = [t for t in _MD_LINK.findall(_text(path)) if "://" not in t and not t.startswith("#")]
    missing = [t for t in links if not (path.parent / t).exists()]
    assert missing == [], f"{path.relative_to(ROOT)} links to missing files"


# ------------------------------------------------------------------ tables in operations.md
def _table_after(text: str, heading: str) -> list[list[str]]:
    """Rows (cells stripped) of the first Markdown table after ``heading``."""
    rest = text[text.index(heading) :]
    rows = []
    started = False
    for line in rest.splitlines():
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= {"-", ":", " "} for c in cells):
                rows.append(cells)
        elif started:
            break
    return rows[1:]  # without the header row


def _code(cell: str) -> str:
    m = re.match(r"`([^`]+)`", cell)
    assert m, cell
    return m.group(1)


def test_metrics_table_lists_exactly_the_exported_families() -> None:
    metrics = WorkerMetrics(CollectorRegistry())
    exported = {}
    for obj in vars(metrics).values():
        if isinstance(obj, MetricWrapperBase):
            name = obj._name + ("_total" if obj._type == "counter" else "")
            name += "_info" if obj._type == "info" else ""
            exported[name] = (obj._type, set(obj._labelnames))
    rows = _table_after(_text(OPERATIONS), "## Metrics")
    documented = {}
    for name, kind, labels, _meaning in rows:
        documented[_code(name)] = (kind, set(re.findall(r"`([^`]+)`", labels)))
    assert sorted(documented) == sorted(exported)
    for name, (kind, labels) in exported.items():
        assert documented[name][0] == kind, name
        if kind != "info":  # an Info's labels are its keys, set at run time
            assert documented[name][1] == labels, name


def test_health_table_lists_exactly_the_served_paths() -> None:
    rows = _table_after(_text(OPERATIONS), "## Health endpoints")
    paths = set()
    for path_cell, *_ in rows:
        paths |= set(re.findall(r"`(/[a-z]+)`", path_cell))
    assert paths == {"/startupz", "/healthz", "/livez", "/readyz"}
    server = HealthServer(CollectorRegistry(), HealthState(), port=0).start()
    try:
        for path in sorted(paths):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5):
                    pass
            except urllib.error.HTTPError as exc:
                assert exc.code == 503, (path, exc.code)
    finally:
        server.stop()


def test_alerts_table_lists_exactly_the_alert_rules() -> None:
    rows = _table_after(_text(OPERATIONS), "## Alerts")
    documented = {_code(r[0]): r[2] for r in rows}
    rules = {r["alert"]: r["labels"]["severity"] for r in alert_rules()}
    assert documented == rules


# ------------------------------------------------------------------ capacity figures
def _capacity_rows(text: str, heading: str) -> dict[str, tuple[str, str]]:
    """workers -> (jobs/s on 1 partition, on 4 partitions) from the table after ``heading``."""
    out = {}
    for workers, one, four in _table_after(text, heading):
        out[workers] = (one.split()[0], four.split()[0])
    return out


def test_scaling_doc_quotes_the_performance_capacity_figures() -> None:
    perf, scaling = _text(PERFORMANCE), _text(SCALING)
    expected = _capacity_rows(perf, "## Queue capacity")
    assert expected and len(expected) == 3
    assert _capacity_rows(scaling, "## Capacity") == expected
    for figure in ("37-54 µs", "8-10 µs", "19,000 jobs/s"):
        assert figure in perf, figure
        assert figure in scaling[scaling.index("## Capacity") :], figure
    best = max(int(v.replace(",", "")) for row in expected.values() for v in row[:1])
    assert f"measured basis ({best:,} jobs/s x P)" in scaling
