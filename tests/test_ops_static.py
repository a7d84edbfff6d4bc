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

from tests.test_ops_promql import (
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


def _deployment() -> dict[str, Any]:
    (dep,) = _k8s("Deployment")
    return dep


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
        "scoring_build_info",
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
        "ScoringWorkerDown", "ScoringQueueLagGrowing", "ScoringErrorRate", "ScoringDeadLetters",
        "ScoringKVOutputsRejected", "ScoringAttentionFallbackRate", "ScoringMemoryNearDeviceLimit",
    } <= names  # fmt: skip


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
    assert {"redis", "worker", "producer", "prometheus", "grafana"} <= set(services)
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
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in ports
    env = _container_env(c)
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    drain = float(env["SCORING_DRAIN_TIMEOUT_S"])
    assert drain < pod["terminationGracePeriodSeconds"] <= drain + 60
    assert int(env["SCORING_METRICS_PORT"]) == ports["metrics"]
    assert env["SCORING_METRICS_HOST"] == "0.0.0.0"
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    assert pod["securityContext"]["runAsNonRoot"] is True


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
    (secret,) = _k8s("Secret")
    keys_in_secret = set(secret["stringData"])
    (c,) = _deployment()["spec"]["template"]["spec"]["containers"]
    for value in _container_env(c).values():
        if isinstance(value, dict) and "secretKeyRef" in value:
            ref = value["secretKeyRef"]
            assert ref["name"] == secret["metadata"]["name"] and ref["key"] in keys_in_secret
    (auth,) = _k8s("TriggerAuthentication")
    for ref in auth["spec"]["secretTargetRef"]:
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in keys_in_secret
        assert ref["parameter"] == "password"


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
    assert [t["metadata"]["stream"] for t in triggers] == expected
    for t in triggers:
        assert t["type"] == "redis-streams"
        assert t["metadata"]["consumerGroup"] == keys.DEFAULT_GROUP
        assert int(t["metadata"]["lagCount"]) > 0
        assert int(t["metadata"]["activationLagCount"]) >= 0
        assert t["authenticationRef"]["name"] == auth["metadata"]["name"]
    (alt,) = _k8s("ScaledObject", "keda-scaledobject-prometheus.yaml")
    assert alt["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert alt["spec"]["minReplicaCount"] >= 1  # worker gauges cannot wake a fleet from zero


def test_podmonitor_selects_the_worker_pods_and_port() -> None:
    (pm,) = _k8s("PodMonitor")
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
def test_promtool_check_config() -> None:
    res = _promtool("check", "config", str(OPS / "prometheus/prometheus.yml"))
    assert res.returncode == 0, res.stdout + res.stderr


@needs_promtool
@pytest.mark.timeout(60)
def test_promtool_check_rules() -> None:
    res = _promtool("check", "rules", str(ALERTS))
    assert res.returncode == 0, res.stdout + res.stderr


@needs_promtool
@pytest.mark.timeout(60)
def test_promtool_alert_unit_tests() -> None:
    res = _promtool("test", "rules", str(OPS / "prometheus/alerts_test.yml"))
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
    """The Redis Cluster variant: one redis-cluster-streams trigger per partition stream."""
    dep = _deployment()
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = _container_env(c)
    expected = keys.job_streams(env["SCORING_QUEUE"], int(env["SCORING_PARTITIONS"]))
    (auth,) = _k8s("TriggerAuthentication")
    (so,) = _k8s("ScaledObject", "keda-scaledobject-cluster.yaml")
    assert so["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert so["spec"]["minReplicaCount"] == 0
    triggers = so["spec"]["triggers"]
    assert [t["metadata"]["stream"] for t in triggers] == expected
    slots = set()
    for t in triggers:
        assert t["type"] == "redis-cluster-streams"
        assert t["metadata"]["consumerGroup"] == keys.DEFAULT_GROUP
        assert all(":" in a for a in t["metadata"]["addresses"].split(","))
        assert t["authenticationRef"]["name"] == auth["metadata"]["name"]
        slots.add(keys.hash_tag(t["metadata"]["stream"]))
    assert len(slots) == len(triggers)  # each partition in its own hash tag
