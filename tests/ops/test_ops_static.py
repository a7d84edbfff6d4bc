"""ops/ and docker-compose.yml checked without Docker or Kubernetes: they parse, refer to files
that exist, use only metric names/labels a worker exports, use only flags the CLI accepts, and
pass promtool (Debian's ``prometheus`` package; skipped when it is not installed)."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from tests.support.ops import (
    ALERTS,
    DASHBOARD,
    ROOT,
    alert_rules,
    dashboard,
    dashboard_queries,
    problems,
    promql_refs,
    series_catalog,
    substitute_grafana,
)
from worker import keys

OPS = ROOT / "ops"
COMPOSE = ROOT / "docker-compose.yml"
K8S = OPS / "k8s"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (apt-get install -y --no-install-recommends prometheus)",
)


def _yaml_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text()))


def _k8s(kind: str, path: str | None = None) -> list[dict[str, Any]]:
    files = [K8S / path] if path else sorted(K8S.glob("*.yaml"))
    return [d for f in files for d in _yaml_docs(f) if d.get("kind") == kind]


def _named(kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in _k8s(kind) if d["metadata"]["name"] == name]
    return found


def _deployment() -> dict[str, Any]:
    """The workers' Deployment (gateway.yaml holds the gateway's)."""
    return _named("Deployment", "scoring-worker")


def _container_env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _subparser(name: str) -> argparse.ArgumentParser:
    """The real parser of one subcommand (imports only that command's module)."""
    from worker.cli import COMMANDS

    parser = argparse.ArgumentParser(prog=f"scoring-worker {name}")
    importlib.import_module(COMMANDS[name][0]).configure(parser)
    return parser


def _parse_cli(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv`` (subcommand first) with the real parser; a drifted flag fails the test."""
    try:
        args = _subparser(argv[0]).parse_args(argv[1:])
    except SystemExit as exc:  # argparse printed why
        raise AssertionError(f"CLI rejects {argv}") from exc
    args.command = argv[0]
    return args


# ------------------------------------------------------------------ every file parses
OPS_YAML = sorted([*OPS.rglob("*.yml"), *OPS.rglob("*.yaml"), COMPOSE])


@pytest.mark.parametrize("path", OPS_YAML, ids=lambda p: str(p.relative_to(ROOT)))
def test_yaml_files_parse(path: Path) -> None:
    assert _yaml_docs(path), f"{path} is empty"


def test_dashboard_json_is_well_formed() -> None:
    d = dashboard()
    assert d["uid"] == "scoring-worker"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "queue", "stream", "instance"} <= names


# ------------------------------------------------------------------ metric names and labels
@pytest.mark.parametrize(("title", "expr"), dashboard_queries(), ids=lambda x: x[:40])
def test_dashboard_queries_use_exported_names_and_labels(title: str, expr: str) -> None:
    found = problems(substitute_grafana(expr), series_catalog())
    assert found == [], f"panel {title!r}: {found}"


def test_dashboard_variables_use_exported_names_and_labels() -> None:
    catalog = series_catalog()
    for var in dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query)
        assert m, f"variable {var['name']}: expected label_values(selector, label), got {query}"
        selector, label = substitute_grafana(m.group(1)), m.group(2)
        assert problems(selector, catalog) == [], var["name"]
        (metric,) = [n for n in promql_refs(selector).metrics if n]
        assert label in catalog[metric][1] | {"instance", "job"}, (var["name"], label)


def test_dashboard_variables_come_from_the_stream_length() -> None:
    """scoring_stream_length is exported for every stream on every Redis version; the lag series
    is absent where Redis cannot tell the lag (< 7), which would empty the variables."""
    d = {v["name"]: v for v in dashboard()["templating"]["list"]}
    for name in ("queue", "stream"):
        query = d[name]["query"]["query"]
        assert query.startswith("label_values(scoring_stream_length"), (name, query)
        assert d[name]["definition"] == query


def test_dashboard_stream_variable_matches_partitioned_and_plain_streams() -> None:
    """The queue variable's regex extracts the logical queue from every partition's stream key,
    and the stream variable's selector (with one queue chosen) matches exactly its partitions."""
    d = {v["name"]: v for v in dashboard()["templating"]["list"]}
    queue_re = re.compile(d["queue"]["regex"].strip("/"))
    streams = [*keys.job_streams("ref-7b", 4), *keys.job_streams("default"), "scoring:{x}:dead"]
    found = {m.group(1) for s in streams if (m := queue_re.match(s))}
    assert found == {"ref-7b", "default"}
    sel = d["stream"]["query"]["query"]
    promql_regex = re.search(r'stream=~"([^"]*)"', sel).group(1)  # type: ignore[union-attr]
    regex = promql_regex.replace("\\\\", "\\").replace("$queue", "(ref-7b)")
    chosen = [s for s in streams if re.fullmatch(regex, s)]
    assert chosen == keys.job_streams("ref-7b", 4)


def test_dashboard_covers_what_operators_need() -> None:
    used = set()
    for _, expr in dashboard_queries():
        used |= set(promql_refs(substitute_grafana(expr)).metrics)
    needed = {
        "scoring_jobs_total", "scoring_tokens_total", "scoring_end_to_end_seconds_bucket",
        "scoring_forward_seconds_bucket", "scoring_queue_wait_seconds_bucket",
        "scoring_stream_lag", "scoring_stream_pending", "scoring_last_batch_peak_allocated_bytes",
        "scoring_last_batch_peak_reserved_bytes", "scoring_device_memory_total_bytes",
        "scoring_attention_fallbacks_total", "scoring_kv_outputs_rejected_total",
        "scoring_dead_lettered_total", "scoring_oom_splits_total", "scoring_worker_up",
        "scoring_model_loaded", "scoring_build_info",
        # prefix sharing: sequence tokens against backbone tokens, shared-prefix tokens
        "scoring_forward_tokens_total", "scoring_shared_prefix_tokens_total",
        # the gateway: requests, coalesced jobs, 4xx/5xx by code, latency
        "scoring_gateway_requests_total", "scoring_gateway_jobs_total",
        "scoring_gateway_errors_total", "scoring_gateway_request_seconds_bucket",
    }  # fmt: skip
    assert needed <= used, sorted(needed - used)


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_alert_rules_use_exported_names_and_labels(rule: dict[str, Any]) -> None:
    assert problems(rule["expr"], series_catalog()) == []
    assert rule["labels"]["severity"] in ("critical", "warning", "info")
    assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_alert_rules_cover_the_failure_modes() -> None:
    names = {r["alert"] for r in alert_rules()}
    assert {
        "ScoringWorkerDown",
        "ScoringQueueLagGrowing",
        "ScoringErrorRate",
        "ScoringDeadLetters",
        "ScoringKVOutputsRejected",
        "ScoringAttentionFallbackRate",
        "ScoringMemoryNearDeviceLimit",
    } <= names


def _rule(name: str) -> dict[str, Any]:
    (rule,) = [r for r in alert_rules() if r["alert"] == name]
    return rule


def _up_matchers(expr: str) -> list[tuple[str, str]]:
    """(label, regex) of every ``up{label=~"regex"}`` selector in ``expr``."""
    return re.findall(r'up\{(\w+)=~"([^"]*)"\}', expr)


def test_worker_down_alert_matches_every_scrape_set_up_in_ops() -> None:
    """ScoringWorkerDown finds the workers' `up` series whatever scrapes them: the compose job,
    the PodMonitor (its jobLabel, or the Operator's default job), and annotation-based scraping
    (job="kubernetes-pods", which sets `pod`)."""
    matchers = _up_matchers(_rule("ScoringWorkerDown")["expr"])
    assert {label for label, _ in matchers} == {"job", "pod"}

    def matched(series: dict[str, str]) -> bool:
        return any(
            label in series and re.fullmatch(regex, series[label]) for label, regex in matchers
        )

    prom = yaml.safe_load((OPS / "prometheus/prometheus.yml").read_text())
    (job,) = [j["job_name"] for j in prom["scrape_configs"] if j.get("dns_sd_configs")]
    assert matched({"job": job})
    pm = _named("PodMonitor", "scoring-worker")
    dep = _deployment()
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert matched({"job": pod_labels[pm["spec"]["jobLabel"]]})
    assert matched({"job": f"ml/{pm['metadata']['name']}"})  # the Operator's default job
    pod = f"{dep['metadata']['name']}-7d9f8c6b5-x2x4q"  # ReplicaSet hash, pod suffix
    assert matched({"job": "kubernetes-pods", "pod": pod})
    assert not matched({"job": "kubernetes-pods", "pod": "redis-master-0"})
    assert not matched({"job": "prometheus"})


def test_loop_stopped_alert_ignores_model_loading_and_draining() -> None:
    refs = promql_refs(_rule("ScoringWorkerLoopStopped")["expr"])
    assert {"scoring_worker_up", "scoring_model_loaded", "scoring_worker_draining"} <= set(
        refs.metrics
    )


def test_keda_prometheus_query_uses_exported_names() -> None:
    (so,) = _k8s("ScaledObject", "keda-scaledobject-prometheus.yaml")
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    query = trigger["metadata"]["query"]
    assert problems(query, series_catalog()) == []
    assert "scoring_stream_lag" in promql_refs(query).metrics
    regex = re.search(r'stream=~"([^"]*)"', query).group(1).replace("\\\\", "\\")  # type: ignore[union-attr]
    assert all(re.fullmatch(regex, s) for s in keys.job_streams("default", 4))
    assert re.fullmatch(regex, keys.job_streams("default")[0])
    assert not re.fullmatch(regex, "scoring:{other:0}:jobs")


# ------------------------------------------------------------------ docker-compose
def test_compose_mounts_build_and_services_exist() -> None:
    compose = _compose()
    services = compose["services"]
    assert {"redis", "worker", "producer", "gateway", "prometheus", "grafana"} <= set(services)
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            src = vol.split(":", 1)[0]
            if src.startswith("."):
                assert (ROOT / src).exists(), f"{name} mounts missing {src}"
        build = svc.get("build")
        if build:
            assert (ROOT / build["context"] / build["dockerfile"]).is_file(), name
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown service {dep}"


def test_compose_redis_keeps_jobs() -> None:
    cmd = " ".join(_compose()["services"]["redis"]["command"])
    assert "--appendonly yes" in cmd
    assert "--maxmemory-policy noeviction" in cmd


def _mounts(service: dict[str, Any]) -> dict[str, Path]:
    """container path -> host path of a service's bind mounts."""
    out = {}
    for vol in service.get("volumes", []):
        parts = vol.split(":")
        if parts[0].startswith("."):
            out[parts[1]] = ROOT / parts[0]
    return out


def _host_path(mounts: dict[str, Path], container_path: str) -> Path | None:
    p = PurePosixPath(container_path)
    for target, host in mounts.items():
        t = PurePosixPath(target)
        if p == t or t in p.parents:
            return host / p.relative_to(t)
    return None


def test_compose_grafana_provisioning_points_at_the_dashboard() -> None:
    services = _compose()["services"]
    mounts = _mounts(services["grafana"])
    assert mounts["/etc/grafana/provisioning/dashboards"] == OPS / "grafana/provisioning/dashboards"
    (provider_file,) = (OPS / "grafana/provisioning/dashboards").glob("*.yml")
    (provider,) = yaml.safe_load(provider_file.read_text())["providers"]
    host_dir = _host_path(mounts, provider["options"]["path"])
    assert host_dir is not None and (host_dir / DASHBOARD.name).is_file()
    (ds,) = yaml.safe_load((OPS / "grafana/provisioning/datasources/prometheus.yml").read_text())[
        "datasources"
    ]
    assert ds["type"] == "prometheus"
    host = re.match(r"https?://([^:/]+)", ds["url"]).group(1)  # type: ignore[union-attr]
    assert host in services


def test_compose_prometheus_loads_the_mounted_rules_and_scrapes_the_worker() -> None:
    services = _compose()["services"]
    prom = services["prometheus"]
    mounts = _mounts(prom)
    cfg_path = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file"))
    host_cfg = _host_path(mounts, cfg_path)
    assert host_cfg is not None and host_cfg.is_file()
    cfg = yaml.safe_load(host_cfg.read_text())
    for rule_file in cfg["rule_files"]:
        in_container = PurePosixPath(cfg_path).parent / rule_file
        host_rules = _host_path(mounts, str(in_container))
        assert host_rules == ALERTS, f"{in_container} is not the mounted alerts.yml"
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "scoring-worker"]
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["worker"]
    worker_args = _parse_cli(services["worker"]["command"])
    assert sd["port"] == worker_args.metrics_port
    assert worker_args.metrics_host == "0.0.0.0"


def test_compose_worker_and_producer_commands_parse() -> None:
    services = _compose()["services"]
    worker = _parse_cli(services["worker"]["command"])
    assert worker.command == "serve"
    assert worker.redis_url.startswith("redis://redis:")
    assert worker.reference_model == "/opt/models/smollm2"
    assert worker.gguf_file.endswith(".gguf")
    (script,) = services["producer"]["command"]
    m = re.search(r"scoring-worker (enqueue [^;]*);", script)
    assert m, "the producer runs `scoring-worker enqueue ...`"
    producer = _parse_cli(shlex.split(m.group(1)))
    assert producer.redis_url == worker.redis_url
    mounts = _mounts(services["producer"])
    host_file = _host_path(mounts, producer.file)
    assert host_file is not None and host_file.is_file()
    vocab = 49152  # SmolLM2's vocabulary: every sample token id must fit it
    for line in host_file.read_text().splitlines():
        row = json.loads(line)
        assert min(row["tokens"]) >= 0 and max(row["tokens"]) < vocab
        assert 0 < row["prompt_len"] < len(row["tokens"])


# ------------------------------------------------------------------ Dockerfile
def _dockerfile() -> str:
    return (OPS / "Dockerfile").read_text()


def _instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_copies_files_that_exist_and_are_not_ignored() -> None:
    instr = _instructions(_dockerfile())
    copies = [rest.split()[:-1] for word, rest in instr if word == "COPY"]
    assert copies
    ignore = (OPS / "Dockerfile.dockerignore").read_text().split()
    for srcs in copies:
        for src in srcs:
            assert (ROOT / src).exists(), src
            assert f"!{src.rstrip('/')}" in ignore or f"!{src.rstrip('/')}/" in ignore, src


def test_dockerfile_base_variants_non_root_entrypoint_and_healthcheck() -> None:
    instr = _instructions(_dockerfile())
    args = dict(rest.split("=", 1) for word, rest in instr if word == "ARG" and "=" in rest)
    assert "cuda" in args["BASE"]
    assert "TORCH_SPEC" in args and "TORCH_INDEX_URL" in args
    users = [rest for word, rest in instr if word == "USER"]
    assert users and not users[-1].startswith(("root", "0:", "0 ")) and users[-1] != "0"
    (entry,) = [rest for word, rest in instr if word == "ENTRYPOINT"]
    (cmd,) = [rest for word, rest in instr if word == "CMD"]
    assert yaml.safe_load(entry) == ["scoring-worker"]
    assert yaml.safe_load(cmd)[0] == "serve"
    (health,) = [rest for word, rest in instr if word == "HEALTHCHECK"]
    check = yaml.safe_load(health[health.index("CMD") + 3 :].strip())
    assert check[:2] == ["scoring-worker", "check"]
    check_args = _parse_cli(check[1:])
    assert check_args.url == ["http://127.0.0.1:9400/healthz"]  # not only a Redis PING
    compose_build_args = _compose()["x-worker-image"]["build"]["args"]
    assert set(compose_build_args) <= set(args) | {"BASE"}


# ------------------------------------------------------------------ Kubernetes
def test_kustomization_resources_exist() -> None:
    (kust,) = _k8s("Kustomization")
    for res in kust["resources"]:
        assert (K8S / res).is_file(), res


def test_deployment_gpu_probes_grace_and_consumer_name() -> None:
    dep = _deployment()
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # /healthz answers 200 while the model loads: the startup probe needs /startupz to bound it
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == "/startupz"
    budget_s = startup["failureThreshold"] * startup["periodSeconds"]
    assert 15 * 60 <= budget_s <= 60 * 60, f"model load budget {budget_s} s"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in ports
    env = _container_env(c)
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    drain = float(env["SCORING_DRAIN_TIMEOUT_S"])
    assert drain < pod["terminationGracePeriodSeconds"] <= drain + 60
    # the rule written beside it: drain = 2 x batch time + 5, grace = drain + 10
    m = re.search(r"batch time B = (\d+(?:\.\d+)?) s", (K8S / "deployment.yaml").read_text())
    assert m, "deployment.yaml states the batch time its grace period comes from"
    batch_s = float(m.group(1))
    assert drain == 2 * batch_s + 5
    assert pod["terminationGracePeriodSeconds"] == drain + 10
    assert int(env["SCORING_METRICS_PORT"]) == ports["metrics"]
    assert env["SCORING_METRICS_HOST"] == "0.0.0.0"
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    assert pod["securityContext"]["runAsNonRoot"] is True


@pytest.mark.timeout(30)
def test_deployment_probe_paths_are_served_by_the_worker() -> None:
    """Every probe path of the Deployment (and the Dockerfile's check URL) is a path the worker's
    HealthServer answers: 503 while the model loads where that matters, never 404."""
    import urllib.error
    import urllib.request

    from prometheus_client import CollectorRegistry

    from worker.observability.health import HealthServer, HealthState

    (c,) = _deployment()["spec"]["template"]["spec"]["containers"]
    paths = {
        p: c[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    state = HealthState()
    server = HealthServer(CollectorRegistry(), state, port=0).start()

    def code(path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5) as r:
                return int(r.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        loading = {probe: code(path) for probe, path in paths.items()}
        assert loading == {"startupProbe": 503, "livenessProbe": 200, "readinessProbe": 503}
        state.model_ready = state.started = state.redis_ok = True
        assert {probe: code(path) for probe, path in paths.items()} == dict.fromkeys(paths, 200)
    finally:
        server.stop()


def test_deployment_env_names_are_serve_flags() -> None:
    """Every SCORING_* variable of the Deployment is the env form of a real serve flag."""
    serve = _subparser("serve")
    flags = {opt for action in serve._actions for opt in action.option_strings}
    global_flags = {"--log-level", "--log-json"}  # worker.cli's root parser
    (c,) = _deployment()["spec"]["template"]["spec"]["containers"]
    for name in _container_env(c):
        if name.startswith("SCORING_"):
            flag = "--" + name[len("SCORING_") :].lower().replace("_", "-")
            assert flag in flags | global_flags, f"{name}: serve has no {flag}"


def test_secret_refs_line_up() -> None:
    secret = _named("Secret", "scoring-worker-redis")
    keys_in_secret = set(secret["stringData"])
    secrets = {s["metadata"]["name"]: set(s["stringData"]) for s in _k8s("Secret")}
    for dep in _k8s("Deployment"):  # the workers' and the gateway's
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        for value in _container_env(c).values():
            if isinstance(value, dict) and "secretKeyRef" in value:
                ref = value["secretKeyRef"]
                assert ref["key"] in secrets.get(ref["name"], set()), ref
    (auth,) = _k8s("TriggerAuthentication")
    for ref in auth["spec"]["secretTargetRef"]:
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in keys_in_secret
        assert ref["parameter"] == "password"


def _lag_and_pending_by_stream(
    triggers: list[dict[str, Any]],
) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """stream -> (its lagCount trigger, its pendingEntriesCount trigger); exactly one of each."""
    lag: dict[str, dict[str, Any]] = {}
    pending: dict[str, dict[str, Any]] = {}
    for t in triggers:
        meta = t["metadata"]
        # KEDA's redis(-cluster)-streams scaler: with consumerGroup set, lagCount wins over
        # pendingEntriesCount, so one trigger cannot measure both.
        if "lagCount" in meta:
            assert "pendingEntriesCount" not in meta, meta
            assert meta["stream"] not in lag, f"two lag triggers on {meta['stream']}"
            lag[meta["stream"]] = t
        else:
            assert "pendingEntriesCount" in meta, meta
            assert meta["stream"] not in pending, f"two pending triggers on {meta['stream']}"
            pending[meta["stream"]] = t
    assert list(lag) == list(pending), "every lag trigger needs a pending trigger on its stream"
    return {stream: (lag[stream], pending[stream]) for stream in lag}


def _check_lag_and_pending_pair(lag: dict[str, Any], pending: dict[str, Any]) -> None:
    from worker.daemon.config import WorkerConfig

    lm, pm = lag["metadata"], pending["metadata"]
    assert lag["type"] == pending["type"]
    assert lm["consumerGroup"] == pm["consumerGroup"] == keys.DEFAULT_GROUP
    assert int(lm["lagCount"]) > 0
    assert int(lm["activationLagCount"]) >= 0
    # A pending trigger is what keeps pods holding prefetched entries: its target is one full
    # prefetch, so it never asks for more pods than it takes to hold what is pending.
    read_count = WorkerConfig(streams=("s",)).read_count
    assert int(pm["pendingEntriesCount"]) == read_count
    lag_conn = {k: v for k, v in lm.items() if k not in ("lagCount", "activationLagCount")}
    pending_conn = {k: v for k, v in pm.items() if k != "pendingEntriesCount"}
    assert lag_conn == pending_conn  # same server, stream and group
    assert lag["authenticationRef"] == pending["authenticationRef"]


def test_keda_redis_triggers_cover_every_partition() -> None:
    dep = _deployment()
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = _container_env(c)
    expected = keys.job_streams(env["SCORING_QUEUE"], int(env["SCORING_PARTITIONS"]))
    (auth,) = _k8s("TriggerAuthentication")
    (so,) = _k8s("ScaledObject", "keda-scaledobject.yaml")
    assert so["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert so["spec"]["minReplicaCount"] == 0  # lagCount is the trigger that wakes from zero
    triggers = so["spec"]["triggers"]
    pairs = _lag_and_pending_by_stream(triggers)
    assert list(pairs) == expected
    for lag, pending in pairs.values():
        assert lag["type"] == "redis-streams"
        _check_lag_and_pending_pair(lag, pending)
        assert lag["authenticationRef"]["name"] == auth["metadata"]["name"]
    (alt,) = _k8s("ScaledObject", "keda-scaledobject-prometheus.yaml")
    assert alt["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert alt["spec"]["minReplicaCount"] >= 1  # worker gauges cannot wake a fleet from zero


def test_keda_prometheus_query_counts_pending_and_survives_a_missing_lag_series() -> None:
    """Pending entries are in the sum, and each side falls back to 0 on its own: on Redis < 7
    the worker exports no lag series, which must not blank the whole query."""
    (so,) = _k8s("ScaledObject", "keda-scaledobject-prometheus.yaml")
    (trigger,) = so["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    assert "scoring_stream_pending" in promql_refs(query).metrics
    for metric in ("scoring_stream_lag", "scoring_stream_pending"):
        pattern = rf"\(sum\(max by \(stream\) \({metric}\{{.*?\}}\)\) or vector\(0\)\)"
        assert re.search(pattern, query), f"{metric} side lacks `or vector(0)`: {query}"


def test_podmonitor_selects_the_worker_pods_and_port() -> None:
    pm = _named("PodMonitor", "scoring-worker")
    dep = _deployment()
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    for k, v in pm["spec"]["selector"]["matchLabels"].items():
        assert pod_labels.get(k) == v
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    port_names = {p["name"] for p in c["ports"]}
    for ep in pm["spec"]["podMetricsEndpoints"]:
        assert ep["port"] in port_names and ep["path"] == "/metrics"


# ------------------------------------------------------------------ promtool
def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=60, check=False
    )


@needs_promtool
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args",
    [
        ("check", "config", OPS / "prometheus/prometheus.yml"),
        ("check", "rules", ALERTS),
        ("test", "rules", OPS / "prometheus/alerts_test.yml"),  # the alert unit tests
    ],
    ids=["check-config", "check-rules", "alert-unit-tests"],
)
def test_promtool_accepts_the_ops_files(args: tuple[str, str, Path]) -> None:
    res = _promtool(*args[:2], str(args[2]))
    assert res.returncode == 0, res.stdout + res.stderr


@needs_promtool
@pytest.mark.timeout(60)
def test_promtool_accepts_every_dashboard_query(tmp_path: Path) -> None:
    """Every panel query (variables substituted) is valid PromQL: wrap them as recording rules."""
    rules = [
        {"record": f"dashboard:q{i}", "expr": substitute_grafana(expr)}
        for i, (_, expr) in enumerate(dashboard_queries())
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    res = _promtool("check", "rules", str(path))
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_install_hint_is_exact() -> None:
    """The skip reason tells CI what to install (keeps .ci/run and this file in step)."""
    assert shlex.split(needs_promtool.kwargs["reason"].split("(", 1)[1].rstrip(")"))[:2] == [
        "apt-get",
        "install",
    ]


def test_keda_cluster_triggers_cover_every_partition() -> None:
    """The Redis Cluster variant: a lag and a pending redis-cluster-streams trigger per partition
    stream."""
    dep = _deployment()
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = _container_env(c)
    expected = keys.job_streams(env["SCORING_QUEUE"], int(env["SCORING_PARTITIONS"]))
    (auth,) = _k8s("TriggerAuthentication")
    (so,) = _k8s("ScaledObject", "keda-scaledobject-cluster.yaml")
    assert so["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert so["spec"]["minReplicaCount"] == 0
    pairs = _lag_and_pending_by_stream(so["spec"]["triggers"])
    assert list(pairs) == expected
    slots = set()
    for stream, (lag, pending) in pairs.items():
        assert lag["type"] == "redis-cluster-streams"
        _check_lag_and_pending_pair(lag, pending)
        assert all(":" in a for a in lag["metadata"]["addresses"].split(","))
        assert lag["authenticationRef"]["name"] == auth["metadata"]["name"]
        slots.add(keys.hash_tag(stream))
    assert len(slots) == len(pairs)  # each partition in its own hash tag


CI_RUN = ROOT / ".ci" / "run"


def _run_install_prometheus(tmp_path: Path, apt_exit: int, policy_exists: bool) -> str:
    """Run ``.ci/run``'s ``install_prometheus`` with a stub ``apt-get`` that records whether the
    policy-rc.d forbids service starts while it runs; returns that record."""
    text = CI_RUN.read_text()
    func = re.search(r"^install_prometheus\(\) \{\n.*?^\}\n", text, re.M | re.S)
    assert func, "install_prometheus() not found in .ci/run"
    policy = tmp_path / "policy-rc.d"
    if policy_exists:
        policy.write_text("#!/bin/sh\nexit 0\n")
        policy.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "apt-get"
    stub.write_text(
        f'#!/bin/sh\n"{policy}"; echo "$1 policy=$?" >>"{tmp_path}/record"\nexit {apt_exit}\n'
    )
    stub.chmod(0o755)
    script = func.group(0) + "install_prometheus; echo rc=$? >>" + f'"{tmp_path}/record"\n'
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "POLICY_RC_D": str(policy)}
    subprocess.run(["bash", "-c", script], env=env, check=True, timeout=30)
    return (tmp_path / "record").read_text()


@pytest.mark.parametrize("apt_exit", [0, 100])
def test_ci_run_forbids_service_starts_only_during_the_prometheus_install(
    tmp_path: Path, apt_exit: int
) -> None:
    record = _run_install_prometheus(tmp_path, apt_exit, policy_exists=False)
    if apt_exit == 0:
        assert record == "update policy=101\ninstall policy=101\nrc=0\n"
    else:
        assert record == f"update policy=101\nrc={apt_exit}\n"
    assert not (tmp_path / "policy-rc.d").exists()  # we wrote it, so we removed it


def test_ci_run_leaves_an_existing_policy_rc_d_alone(tmp_path: Path) -> None:
    record = _run_install_prometheus(tmp_path, 0, policy_exists=True)
    assert record == "update policy=0\ninstall policy=0\nrc=0\n"
    assert (tmp_path / "policy-rc.d").read_text() == "#!/bin/sh\nexit 0\n"


def test_ci_run_ends_no_process_by_name() -> None:
    code = [line.split("#", 1)[0] for line in CI_RUN.read_text().splitlines()]
    for word in ("pkill", "killall", "systemctl"):
        assert not any(word in line for line in code), word


@pytest.mark.parametrize("path", ["keda-scaledobject.yaml", "keda-scaledobject-cluster.yaml"])
def test_keda_scaledobjects_carry_the_simulations_recommendation(path: str) -> None:
    """The values ``scoring-worker bench --suite autoscale`` picks (``RECOMMENDED``) are what
    ``ops/k8s`` ships: docs/operations.md, "Autoscaling settings", shows why."""
    from worker.devtools.autoscale.recommended import RECOMMENDED, manifest_fields

    want = manifest_fields(RECOMMENDED)
    (so,) = _k8s("ScaledObject", path)
    spec = so["spec"]
    down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    got = {
        "pollingInterval": spec["pollingInterval"],
        "cooldownPeriod": spec["cooldownPeriod"],
        "minReplicaCount": spec["minReplicaCount"],
        "stabilizationWindowSeconds": down["stabilizationWindowSeconds"],
        "scaleDownPolicies": down["policies"],
    }
    for key in got:
        assert got[key] == want[key], (
            f"{path}: {key} is {got[key]}, the simulation picks {want[key]}"
        )
    pairs = _lag_and_pending_by_stream(spec["triggers"])
    assert len(pairs) == RECOMMENDED.partitions
    modifiers = spec["advanced"].get("scalingModifiers")
    if RECOMMENDED.combine == "sum":
        # One composite metric: the sum of every trigger's value against one target.
        assert modifiers is not None, f"{path}: the pick scales on lag + pending (scalingModifiers)"
        names = [t["name"] for t in spec["triggers"]]
        assert sorted(re.findall(r"[A-Za-z_]\w*", modifiers["formula"])) == sorted(names)
        assert set(re.sub(r"[A-Za-z_]\w*|\s", "", modifiers["formula"])) == {"+"}
        assert modifiers["target"] == want["lagCount"]
        assert modifiers["activationTarget"] == want["activationLagCount"]
        assert modifiers.get("metricType", "AverageValue") == "AverageValue"
    else:
        assert modifiers is None
        for lag, _pending in pairs.values():
            assert lag["metadata"]["lagCount"] == want["lagCount"]
            assert lag["metadata"]["activationLagCount"] == want["activationLagCount"]


def test_keda_prometheus_scaledobject_follows_the_recommendation() -> None:
    """The Prometheus variant sums lag and pending already (the pick's metric): its threshold is
    the pick's target, its behavior the pick's; minReplicaCount stays >= 1 (gauges cannot wake a
    fleet from zero)."""
    from worker.devtools.autoscale.recommended import RECOMMENDED, manifest_fields

    want = manifest_fields(RECOMMENDED)
    (so,) = _k8s("ScaledObject", "keda-scaledobject-prometheus.yaml")
    spec = so["spec"]
    (trigger,) = spec["triggers"]
    assert RECOMMENDED.combine == "sum"
    assert trigger["metadata"]["threshold"] == want["lagCount"]
    assert trigger["metadata"]["activationThreshold"] == want["activationLagCount"]
    assert spec["pollingInterval"] == want["pollingInterval"]
    down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert down["stabilizationWindowSeconds"] == want["stabilizationWindowSeconds"]
    assert down["policies"] == want["scaleDownPolicies"]
    assert spec["minReplicaCount"] >= 1


# ------------------------------------------------------------------ the gateway
def _gateway_container() -> dict[str, Any]:
    (c,) = _named("Deployment", "scoring-gateway")["spec"]["template"]["spec"]["containers"]
    return c


def test_gateway_deployment_runs_the_gateway_with_its_key_from_a_secret() -> None:
    c = _gateway_container()
    args = _parse_cli(c["args"])
    assert args.command == "gateway"
    flags = {o for a in _subparser("gateway")._actions for o in a.option_strings}
    env = _container_env(c)
    for name in env:  # every SCORING_* variable is the env form of a real gateway flag
        if name.startswith("SCORING_"):
            flag = "--" + name[len("SCORING_") :].lower().replace("_", "-")
            flag = flag.replace("--gateway-", "--")
            assert flag in flags | {"--log-json"}, f"{name}: gateway has no {flag}"
    assert env["SCORING_GATEWAY_API_KEY"] == {
        "secretKeyRef": {"name": "scoring-gateway", "key": "api-key"}
    }
    assert env["SCORING_GATEWAY_HOST"] == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert int(env["SCORING_GATEWAY_PORT"]) == ports["http"]
    # the gateway feeds the queue and partitions the workers serve
    (w,) = _deployment()["spec"]["template"]["spec"]["containers"]
    for name in ("SCORING_QUEUE", "SCORING_PARTITIONS"):
        assert env[name] == _container_env(w)[name], name
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    grace = _named("Deployment", "scoring-gateway")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    assert grace >= float(env["SCORING_GATEWAY_TIMEOUT_S"])  # in-flight requests are answered


def test_gateway_readiness_is_health_which_needs_no_key_and_no_worker() -> None:
    from worker.gateway.config import OPEN_PATHS

    c = _gateway_container()
    probe = c["readinessProbe"]["httpGet"]
    assert probe["path"] in OPEN_PATHS and probe["port"] == "http"
    assert "httpGet" not in c["livenessProbe"]  # a Redis outage is no reason to restart


def test_gateway_service_and_podmonitor_select_its_pods_and_port() -> None:
    dep = _named("Deployment", "scoring-gateway")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    port_names = {p["name"] for p in _gateway_container()["ports"]}
    svc = _named("Service", "scoring-gateway")
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert all(p["targetPort"] in port_names for p in svc["spec"]["ports"])
    pm = _named("PodMonitor", "scoring-gateway")
    assert all(labels.get(k) == v for k, v in pm["spec"]["selector"]["matchLabels"].items())
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert ep["port"] in port_names and ep["path"] == "/metrics"
    creds = ep["authorization"]["credentials"]  # /metrics is behind the key
    assert creds == {"name": "scoring-gateway", "key": "api-key"}
    # the workers' alert on `up` does not count the gateways
    assert labels["app.kubernetes.io/name"] != "scoring-worker"


def test_compose_gateway_command_parses_and_prometheus_scrapes_it() -> None:
    services = _compose()["services"]
    gw = services["gateway"]
    args = _parse_cli(gw["command"])
    assert args.command == "gateway" and args.host == "0.0.0.0"
    assert args.redis_url == _parse_cli(services["worker"]["command"]).redis_url
    assert any(p.endswith(f":{args.port}") for p in gw["ports"])
    cfg = yaml.safe_load((OPS / "prometheus/prometheus.yml").read_text())
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "scoring-gateway"]
    assert job["static_configs"][0]["targets"] == [f"gateway:{args.port}"]
    assert job["authorization"]["credentials"] == gw["environment"]["SCORING_GATEWAY_API_KEY"]
    assert "gateway" in _dockerfile().split('pip install ".[', 1)[1].split("]", 1)[0]
