"""What the ops tests share: a small PromQL reference extractor (metric names and labels), the
catalog of exported series it is checked against, and readers for the dashboard and alert rules.

``tests/ops/test_ops_static.py``, ``tests/system/test_ops_live.py`` and
``tests/ops/test_ops_docs.py`` use them; ``tests/ops/test_ops_promql.py`` makes sure the extractor
itself catches a drifted name or label (a checker that cannot fail is worthless).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from worker.observability.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "ops" / "grafana" / "dashboards" / "scoring-worker.json"
ALERTS = ROOT / "ops" / "prometheus" / "alerts.yml"

# Labels Prometheus (or the Kubernetes service discovery in ops/k8s) attaches to every series.
TARGET_LABELS = frozenset({"instance", "job", "pod", "namespace", "node", "container", "endpoint"})
# Series Prometheus itself synthesises for every target.
SYNTHETIC_SERIES = {"up": frozenset()}

_KEYWORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
     "bool", "offset", "inf", "nan", "atan2"}
)  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^{}]*)\}")
_MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_IDENT = re.compile(r"(?<![\w:.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()")
_GRAFANA_VAR = re.compile(r"\$\{?(\w+)(?::\w+)?\}?")


def substitute_grafana(expr: str, *, window: str = "5m", value: str = ".*") -> str:
    """Replace Grafana variables: interval/range built-ins by ``window``, template vars by
    ``value`` (a regex that matches every label value)."""

    def repl(m: re.Match[str]) -> str:
        name = m.group(1)
        if name in ("__rate_interval", "__interval", "__range", "__range_s"):
            return window
        return value

    return _GRAFANA_VAR.sub(repl, expr)


@dataclass
class Refs:
    """What one expression refers to."""

    metrics: dict[str, set[str]] = field(default_factory=dict)  # series -> matcher labels
    grouping: set[str] = field(default_factory=set)  # labels in by/without/on/ignoring


def promql_refs(expr: str) -> Refs:
    """Metric identifiers (with the labels their matchers use) and grouping labels of ``expr``.

    Grafana variables must be substituted first (:func:`substitute_grafana`).
    """
    refs = Refs()
    text = _STRING.sub('""', expr)
    for m in _GROUPING.finditer(text):
        refs.grouping |= {x.strip() for x in m.group(2).split(",") if x.strip()}
    text = _GROUPING.sub(" ", text)
    for m in _SELECTOR.finditer(text):
        labels = set(_MATCHER_LABEL.findall(m.group(2)))
        name = m.group(1)
        if name and name not in _KEYWORDS:
            refs.metrics.setdefault(name, set()).update(labels)
        elif "__name__" not in labels:
            refs.metrics.setdefault("", set()).update(labels)  # bare {..}: labels on any family
    text = _SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", text)
    text = _RANGE.sub(" ", text)
    for name in _IDENT.findall(text):
        if name not in _KEYWORDS:
            refs.metrics.setdefault(name, set())
    return refs


def series_catalog(metrics: WorkerMetrics | None = None) -> dict[str, tuple[str, frozenset[str]]]:
    """Every series name a ``WorkerMetrics`` or the gateway's ``GatewayMetrics`` can export ->
    (family, label names)."""
    from worker.gateway.metrics import GatewayMetrics

    metrics = metrics or WorkerMetrics(CollectorRegistry())
    out: dict[str, tuple[str, frozenset[str]]] = {}
    sources = [*vars(metrics).values(), *vars(GatewayMetrics(CollectorRegistry())).values()]
    for obj in sources:
        if not isinstance(obj, MetricWrapperBase):
            continue
        name, kind, labels = obj._name, obj._type, frozenset(obj._labelnames)
        if kind == "counter":
            out[name + "_total"] = (name, labels)
            out[name + "_created"] = (name, labels)
        elif kind == "histogram":
            out[name + "_bucket"] = (name, labels | {"le"})
            out[name + "_count"] = (name, labels)
            out[name + "_sum"] = (name, labels)
            out[name + "_created"] = (name, labels)
        elif kind == "info":
            out[name + "_info"] = (name, labels)
        else:
            out[name] = (name, labels)
    for name, labels in SYNTHETIC_SERIES.items():
        out[name] = (name, labels)
    return out


def problems(expr: str, catalog: dict[str, tuple[str, frozenset[str]]]) -> list[str]:
    """Names or labels in ``expr`` that no exported family has (empty list: all good)."""
    refs = promql_refs(expr)
    out: list[str] = []
    known: set[str] = set(TARGET_LABELS)
    for name, labels in refs.metrics.items():
        if not name:
            continue
        if name not in catalog:
            out.append(f"unknown metric {name!r}")
            continue
        family_labels = catalog[name][1] | TARGET_LABELS
        known |= family_labels
        out += [f"{name} has no label {lab!r}" for lab in sorted(labels - family_labels)]
    for lab in sorted(refs.metrics.get("", set()) - known):
        out.append(f"no referenced family has label {lab!r}")
    out += [
        f"grouping label {lab!r} is on no referenced family"
        for lab in sorted(refs.grouping - known)
    ]
    return out


def dashboard() -> dict[str, Any]:
    """The provisioned Grafana dashboard."""
    return dict(json.loads(DASHBOARD.read_text()))


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana variables left in) for every panel target."""
    out = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def alert_rules() -> list[dict[str, Any]]:
    """Every rule in ops/prometheus/alerts.yml."""
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]
