"""deploy/: the Kubernetes manifests, the Grafana dashboard and the Dockerfile agree with the
gateway they deploy (its policy schema, CLI flags, probes, ports and metric names)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from sluice.cli import build_parser
from sluice.config import Policy, load_policy
from sluice.core.clock import FakeClock
from sluice.core.controller import Controller
from sluice.gateway.telemetry import Telemetry

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
CONFIGMAP = K8S / "configmap.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "sluice-dashboard.json"
NAMESPACE = "ai-gateway"
CLUSTER_SCOPED = {"Namespace"}

# The default queues (config.DEFAULT_QUEUES), exactly as the ConfigMap writes them.
SEED_QUEUES = [
    {
        "priority": 0,
        "name": "realtime-interactive",
        "maxQueueSize": 200,
        "timeout": "8s",
        "dropPolicy": "tail",
    },
    {
        "priority": 1,
        "name": "agent-workflow",
        "maxQueueSize": 500,
        "timeout": "15s",
        "dropPolicy": "early-drop-on-pressure",
    },
    {
        "priority": 2,
        "name": "batch-extraction",
        "maxQueueSize": 1000,
        "timeout": "60s",
        "dropPolicy": "fast-reject",
    },
]

# The metric families the dashboard must show (the gateway's documented set).
REQUIRED_ON_DASHBOARD = {
    "sluice_requests_total",
    "sluice_rejections_total",
    "sluice_client_retries_total",
    "sluice_upstream_aborts_total",
    "sluice_upstream_errors_total",
    "sluice_fallbacks_total",
    "sluice_ttft_seconds_bucket",
    "sluice_request_duration_seconds_bucket",
    "sluice_queue_wait_seconds_bucket",
    "sluice_pressure",
    "sluice_queue_depth",
    "sluice_queue_oldest_seconds",
    "sluice_backend_limit",
    "sluice_backend_inflight",
    "sluice_backend_kv_usage",
    "sluice_backend_waiting",
    "sluice_backend_healthy",
    "sluice_backend_metrics_fresh",
}


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def objects() -> list[dict[str, Any]]:
    return [d for p in manifest_files() for d in documents(p)]


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        o
        for o in objects()
        if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def gateway_container() -> dict[str, Any]:
    containers = one("Deployment", "sluice")["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "sluice")


def container_port(container: dict[str, Any], ref: int | str) -> int:
    """A probe's or Service's port, by number or by the container port's name."""
    for p in container["ports"]:
        if ref in (p["containerPort"], p.get("name")):
            return int(p["containerPort"])
    raise AssertionError(f"port {ref!r} is not one of the container's ports")


def exported_series() -> set[str]:
    """Every series name the gateway's /metrics can carry: its registry's families plus the
    gauges read from a real controller's snapshot."""
    telemetry = Telemetry()
    controller = Controller(Policy().core_settings(), FakeClock(), backends=["vllm-0"])
    telemetry.watch_state(controller.snapshot)
    names: set[str] = set()
    for family in telemetry.registry.collect():
        if family.type == "counter":
            names |= {family.name + "_total", family.name + "_created"}
        elif family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count", "_created")}
        else:
            names.add(family.name)
    return names


# --- every manifest ------------------------------------------------------------------------


def test_every_manifest_parses_and_is_a_named_object_in_the_namespace() -> None:
    files = manifest_files() + sorted((REPO / "deploy" / "prometheus").glob("*monitor.yaml"))
    kinds = set()
    for path in files:
        docs = documents(path)
        assert docs, f"{path.name} holds no document"
        for doc in docs:
            where = f"{path.name}: {doc.get('kind')} {doc.get('metadata', {}).get('name')}"
            assert doc.get("apiVersion"), where
            assert doc.get("kind"), where
            assert doc.get("metadata", {}).get("name"), where
            if doc["kind"] in CLUSTER_SCOPED:
                assert "namespace" not in doc["metadata"], where
            else:
                assert doc["metadata"].get("namespace") == NAMESPACE, where
            kinds.add(doc["kind"])
    assert {
        "Namespace",
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "NetworkPolicy",
    } <= kinds
    assert one("Namespace")["metadata"]["name"] == NAMESPACE


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))
    assert sorted(kustomization["resources"]) == sorted(p.name for p in manifest_files())


# --- the policy ConfigMap ------------------------------------------------------------------


def test_check_config_accepts_the_configmap() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "check-config", str(CONFIGMAP)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "OK (P0 realtime-interactive, P1 agent-workflow, P2 batch-extraction" in result.stdout


def test_configmap_is_the_seeds_with_its_queues_unchanged() -> None:
    cm = one("ConfigMap", "gateway-overload-policy")
    assert cm["apiVersion"] == "v1"
    assert cm["metadata"]["namespace"] == NAMESPACE
    policy = yaml.safe_load(cm["data"]["policy.yaml"])
    assert policy["queues"] == SEED_QUEUES


def test_configmap_holds_no_plaintext_key() -> None:
    policy = yaml.safe_load(one("ConfigMap")["data"]["policy.yaml"])
    assert policy["tenants"]
    for holder in [*policy["tenants"], policy["admin"]]:
        assert "apiKeys" not in holder
        assert holder["apiKeySha256"]
        assert all(re.fullmatch(r"[0-9a-f]{64}", k) for k in holder["apiKeySha256"])


def test_the_replicas_share_the_booking_key_from_an_optional_secret() -> None:
    # a refused client's return lands on any pod: they sign its token with one key
    policy = load_policy(CONFIGMAP)
    assert policy.retry_after.rule == "booking" and policy.retry_after.secret_env
    env = {e["name"]: e for e in gateway_container()["env"]}
    ref = env[policy.retry_after.secret_env]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == "sluice-booking-key" and ref["optional"] is True


def test_configmap_points_at_the_in_cluster_redis_and_backends() -> None:
    policy = load_policy(CONFIGMAP)
    assert policy.redis is not None
    url = urlsplit(policy.redis.url)
    redis_svc = one("Service", "sluice-redis")
    assert url.scheme == "redis"
    assert url.hostname == f"sluice-redis.{NAMESPACE}.svc"
    assert url.port in [p["port"] for p in redis_svc["spec"]["ports"]]
    assert policy.backends
    for b in policy.backends:
        assert urlsplit(b.url).hostname.endswith(f".{NAMESPACE}.svc")


# --- the Deployment ------------------------------------------------------------------------


def test_deployment_runs_the_gateway_on_the_mounted_configmap() -> None:
    deploy = one("Deployment", "sluice")
    pod = deploy["spec"]["template"]["spec"]
    c = gateway_container()
    args = build_parser("serve").parse_args(["serve", *c["args"]])  # valid flags only
    assert args.config == "/etc/sluice/policy.yaml"
    assert args.host == "0.0.0.0"
    assert container_port(c, args.port) == args.port
    # The ConfigMap is mounted as the config file's folder, never by subPath (a subPath
    # mount is not updated, so hot reload would never see a change).
    volume = next(v for v in pod["volumes"] if v.get("configMap"))
    assert volume["configMap"]["name"] == "gateway-overload-policy"
    mount = next(m for m in c["volumeMounts"] if m["name"] == volume["name"])
    assert "subPath" not in mount
    assert str(Path(args.config).parent) == mount["mountPath"]
    assert deploy["spec"]["replicas"] == 3
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_deployment_probes_use_healthz_for_liveness_and_readyz_for_readiness() -> None:
    c = gateway_container()
    # Liveness must not be /readyz: backends down would restart every gateway.
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert container_port(c, c[probe]["httpGet"]["port"]) == 8080


def test_termination_grace_outlasts_prestop_and_shutdown_grace() -> None:
    pod = one("Deployment", "sluice")["spec"]["template"]["spec"]
    c = gateway_container()
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    prestop_s = float(command[1])
    shutdown_grace_s = load_policy(CONFIGMAP).server.shutdown_grace
    assert shutdown_grace_s > 0
    assert pod["terminationGracePeriodSeconds"] > prestop_s + shutdown_grace_s


def test_deployment_is_non_root_read_only_and_sized() -> None:
    pod = one("Deployment", "sluice")["spec"]["template"]["spec"]
    c = gateway_container()
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    # A read-only root still needs a writable /tmp.
    tmp = next(m for m in c["volumeMounts"] if m["mountPath"] == "/tmp")
    assert any(v["name"] == tmp["name"] and "emptyDir" in v for v in pod["volumes"])
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= c["resources"][kind].keys()
    assert pod["affinity"]["podAntiAffinity"]


def test_image_user_and_port_match_the_deployment() -> None:
    dockerfile = (REPO / "Dockerfile").read_text(encoding="utf-8")
    user = re.findall(r"^USER\s+(\d+)", dockerfile, re.MULTILINE)
    expose = re.findall(r"^EXPOSE\s+(\d+)", dockerfile, re.MULTILINE)
    pod = one("Deployment", "sluice")["spec"]["template"]
    assert user and int(user[-1]) == pod["spec"]["securityContext"]["runAsUser"]
    assert expose and container_port(gateway_container(), int(expose[-1])) == 8080
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == expose[-1]
    assert re.search(r'^ENTRYPOINT \["sluice", "serve"\]$', dockerfile, re.MULTILINE)


def test_service_pdb_and_hpa_select_the_gateway_pods() -> None:
    labels = one("Deployment", "sluice")["spec"]["template"]["metadata"]["labels"]
    svc = one("Service", "sluice")
    assert svc["spec"]["selector"].items() <= labels.items()
    for port in svc["spec"]["ports"]:
        assert container_port(gateway_container(), port["targetPort"]) == 8080
    pdb = one("PodDisruptionBudget", "sluice")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"].get("maxUnavailable") == 1 or pdb["spec"].get("minAvailable") is not None
    hpa = one("HorizontalPodAutoscaler", "sluice")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "sluice",
    }
    assert hpa["spec"]["minReplicas"] <= 3 <= hpa["spec"]["maxReplicas"]


def test_hpa_scales_on_a_metric_the_gateway_exports_and_on_cpu() -> None:
    metrics = one("HorizontalPodAutoscaler", "sluice")["spec"]["metrics"]
    pods = [m["pods"]["metric"]["name"] for m in metrics if m["type"] == "Pods"]
    cpu = [m for m in metrics if m["type"] == "Resource" and m["resource"]["name"] == "cpu"]
    assert pods and set(pods) <= {"sluice_queue_depth", "sluice_pressure"}
    assert set(pods) <= exported_series()
    assert cpu
    adapter = yaml.safe_load((REPO / "deploy/prometheus/adapter-values.yaml").read_text())
    served = {r["name"]["as"] for r in adapter["rules"]["custom"]}
    assert set(pods) <= served


def test_redis_runs_without_persistence_and_only_the_gateway_reaches_it() -> None:
    redis = one("Deployment", "sluice-redis")
    command = redis["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[0] == "redis-server"
    assert command[command.index("--save") + 1] == ""
    assert command[command.index("--appendonly") + 1] == "no"
    policy = one("NetworkPolicy", "sluice-redis")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= (
        redis["spec"]["template"]["metadata"]["labels"].items()
    )
    allowed = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    gateway_labels = one("Deployment", "sluice")["spec"]["template"]["metadata"]["labels"]
    assert allowed.items() <= gateway_labels.items()


# --- the Grafana dashboard -----------------------------------------------------------------


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        q = var.get("query")
        exprs.append(q["query"] if isinstance(q, dict) else str(q or ""))
    return exprs


def test_dashboard_queries_only_metrics_the_gateway_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queried = {n for e in dashboard_queries(dashboard) for n in re.findall(r"sluice_\w+", e)}
    exported = exported_series()
    assert exported >= REQUIRED_ON_DASHBOARD  # the documented set is still the gateway's
    assert queried - exported == set()
    assert queried >= REQUIRED_ON_DASHBOARD


def test_dashboard_panels_use_the_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert graphs
    for p in graphs:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]


@pytest.mark.parametrize("quantile", ["0.5", "0.95"])
def test_dashboard_shows_ttft_quantile_by_class(quantile: str) -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    pattern = (
        rf"histogram_quantile\({quantile}, sum by \(le, priority\) "
        r"\(rate\(sluice_ttft_seconds_bucket"
    )
    assert any(re.search(pattern, e) for e in dashboard_queries(dashboard))
