"""Policies over the rendered objects, for every scenario: hardened, probed, bounded pods;
RBAC limited to the sandbox namespace; the network policies the sandboxes rely on; the
upgrade and scaling behaviour docs/kubernetes.md promises."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.chart.conftest import (
    FULLNAME,
    NAMESPACE,
    PRODUCTION,
    SCENARIOS,
    Helm,
    find,
    kinds,
    pod_specs,
)

pytestmark = pytest.mark.xdist_group("chart")

Objects = dict[str, list[dict[str, Any]]]

# The workers' Role in the sandbox namespace, exactly (the Kubernetes settings contract):
# what the backend uses, as tests/k8s/test_rbac.py sees it on a real API server.
ROLE_RULES = {
    "pods": {"get", "list", "watch", "create", "delete"},
    "secrets": {"get", "list", "create", "delete"},
    "events": {"list"},
}
SANDBOX_NAMESPACE = "orchestrator-sandboxes"


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_container_is_bounded_probed_and_hardened(rendered: Objects, scenario: str) -> None:
    pods = pod_specs(rendered[scenario])
    assert {"Deployment/" + FULLNAME + "-api", "StatefulSet/" + FULLNAME + "-worker"} <= set(pods)
    for workload, pod in pods.items():
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True, workload
        assert context["runAsUser"] > 0, workload
        assert context["seccompProfile"]["type"] == "RuntimeDefault", workload
        for container in pod["containers"]:
            where = f"{scenario}: {workload}/{container['name']}"
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), where
            assert {"cpu", "memory"} <= set(resources["limits"]), where
            if not workload.startswith("Job/"):
                # A Job's container (the uninstall hook) runs once and ends: nothing to probe.
                assert "livenessProbe" in container, where
                assert "readinessProbe" in container, where
            sc = container["securityContext"]
            assert sc["runAsNonRoot"] is True, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert "add" not in sc["capabilities"], where
            assert sc["seccompProfile"]["type"] == "RuntimeDefault", where
            assert not container["image"].endswith(":latest"), where
        # Init containers may skip probes, but not the rest.
        for container in pod.get("initContainers", []):
            assert container["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_rbac_is_namespaced_and_exactly_the_contract(rendered: Objects, scenario: str) -> None:
    objects = rendered[scenario]
    assert not {"ClusterRole", "ClusterRoleBinding"} & kinds(objects)
    hooks = [o for o in objects if "helm.sh/hook" in o["metadata"].get("annotations", {})]
    roles = [o for o in objects if o["kind"] == "Role" and o not in hooks]
    assert len(roles) == 1
    role = roles[0]
    assert role["metadata"]["namespace"] == SANDBOX_NAMESPACE
    # The uninstall hook's (templates/uninstall-hook.yaml), which lives only while it runs:
    # list and delete sandboxes and their Secrets, nothing more.
    (hook_role,) = [o for o in hooks if o["kind"] == "Role"]
    assert hook_role["metadata"]["namespace"] == SANDBOX_NAMESPACE
    assert hook_role["metadata"]["annotations"]["helm.sh/hook"] == "post-delete"
    assert hook_role["rules"] == [
        {"apiGroups": [""], "resources": ["pods", "secrets"], "verbs": ["list", "delete"]}
    ]
    rules: dict[str, set[str]] = {}
    for rule in role["rules"]:
        assert rule["apiGroups"] == [""]
        for resource in rule["resources"]:
            rules.setdefault(resource, set()).update(rule["verbs"])
    assert rules == ROLE_RULES
    binding = find(objects, "RoleBinding", f"{FULLNAME}-sandboxes")
    assert binding["metadata"]["namespace"] == SANDBOX_NAMESPACE
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{FULLNAME}-worker", "namespace": NAMESPACE}
    ]


def test_only_workers_get_a_kubernetes_token(rendered: Objects) -> None:
    pods = pod_specs(rendered["default"])
    uninstall = f"Job/{FULLNAME}-uninstall"
    for workload, pod in pods.items():
        needs_one = workload in (f"StatefulSet/{FULLNAME}-worker", uninstall)
        assert pod["automountServiceAccountToken"] is needs_one, workload
    assert pods[f"StatefulSet/{FULLNAME}-worker"]["serviceAccountName"] == f"{FULLNAME}-worker"
    assert pods[uninstall]["serviceAccountName"] == f"{FULLNAME}-uninstall"


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_sandboxes_have_no_egress_and_only_workers_reach_their_agent(
    rendered: Objects, scenario: str
) -> None:
    policy = find(rendered[scenario], "NetworkPolicy", f"{FULLNAME}-sandbox-deny-all")
    spec = policy["spec"]
    assert policy["metadata"]["namespace"] == SANDBOX_NAMESPACE
    assert spec["podSelector"]["matchLabels"]["orchestrator/role"] == "sandbox"
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}
    assert spec["egress"] == []
    [ingress] = spec["ingress"]
    assert ingress["ports"] == [{"protocol": "TCP", "port": 7070}]
    [peer] = ingress["from"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": NAMESPACE}
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    worker = find(rendered[scenario], "StatefulSet", f"{FULLNAME}-worker")
    worker_labels = worker["spec"]["template"]["metadata"]["labels"]
    assert peer["podSelector"]["matchLabels"].items() <= worker_labels.items()
    config = find(rendered[scenario], "ConfigMap", f"{FULLNAME}-config")["data"]
    assert config["ORCH_K8S_AGENT_PORT"] == "7070"
    assert (
        spec["podSelector"]["matchLabels"]["orchestrator/deployment"] == (config["ORCH_DEPLOYMENT"])
    )


@pytest.mark.parametrize("scenario", ["default", "keda-bundled-redis", "production-bundled-hpa"])
def test_redis_is_reachable_only_from_the_release(rendered: Objects, scenario: str) -> None:
    objects = rendered[scenario]
    policy = find(objects, "NetworkPolicy", f"{FULLNAME}-redis")
    [ingress] = policy["spec"]["ingress"]
    components = {
        p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        for p in ingress["from"]
        if "podSelector" in p
    }
    assert components == {"api", "worker", "reaper"}
    namespaces = [p for p in ingress["from"] if "namespaceSelector" in p]
    keda = any(o["kind"] == "ScaledObject" for o in objects)
    assert len(namespaces) == (1 if keda else 0)
    assert ingress["ports"] == [{"protocol": "TCP", "port": 6379}]


def test_bundled_redis_keeps_an_append_only_file_on_a_volume(rendered: Objects) -> None:
    redis = find(rendered["default"], "StatefulSet", f"{FULLNAME}-redis")
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "everysec"
    [claim] = redis["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    mounts = redis["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "data", "mountPath": "/data"} in mounts
    assert "StatefulSet" not in {
        o["kind"] for o in rendered["external-redis"] if o["metadata"]["name"].endswith("redis")
    }


def test_upgrades_drain_workers_and_keep_api_capacity(rendered: Objects) -> None:
    for scenario in ("default", "production"):
        objects = rendered[scenario]
        grace = float(find(objects, "ConfigMap", f"{FULLNAME}-config")["data"][
            "ORCH_WORKER_SHUTDOWN_GRACE_S"
        ])  # fmt: skip
        worker = find(objects, "StatefulSet", f"{FULLNAME}-worker")
        assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace
        assert worker["spec"]["updateStrategy"]["type"] == "RollingUpdate"
        api = find(objects, "Deployment", f"{FULLNAME}-api")
        assert api["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        # Reapers share a lease: a standby, and a rolling update that overlaps them.
        reaper = find(objects, "Deployment", f"{FULLNAME}-reaper")
        assert reaper["spec"]["replicas"] == 2
        assert "strategy" not in reaper["spec"]
        budgets = {
            o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "PodDisruptionBudget"
        }
        assert budgets[f"{FULLNAME}-api"]["minAvailable"] >= 1
        assert budgets[f"{FULLNAME}-worker"]["maxUnavailable"] == 1


def test_probes_point_at_what_the_app_and_chart_provide(rendered: Objects) -> None:
    objects = rendered["default"]
    api = find(objects, "Deployment", f"{FULLNAME}-api")["spec"]["template"]["spec"]
    container = api["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    probes = find(objects, "ConfigMap", f"{FULLNAME}-probes")["data"]
    for kind, name in [("StatefulSet", "worker"), ("Deployment", "reaper")]:
        pod = find(objects, kind, f"{FULLNAME}-{name}")["spec"]["template"]["spec"]
        [container] = pod["containers"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            command = container[probe]["exec"]["command"]
            script = command[1]
            assert script.startswith(mounts["probes"] + "/")
            assert script.rsplit("/", 1)[1] in probes


@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        ("default", None),
        ("hpa", "HorizontalPodAutoscaler"),
        ("keda-bundled-redis", "ScaledObject"),
        ("production", "ScaledObject"),
        ("production-bundled-hpa", "HorizontalPodAutoscaler"),
    ],
)
def test_one_autoscaler_per_mode_targets_the_workers(
    rendered: Objects, scenario: str, expected: str | None
) -> None:
    objects = rendered[scenario]
    scalers = [o for o in objects if o["kind"] in {"HorizontalPodAutoscaler", "ScaledObject"}]
    worker = find(objects, "StatefulSet", f"{FULLNAME}-worker")
    if expected is None:
        assert scalers == []
        assert worker["spec"]["replicas"] == 2
        return
    [scaler] = scalers
    assert scaler["kind"] == expected
    # The autoscaler owns the replica count; a fixed one would fight it on every upgrade.
    assert "replicas" not in worker["spec"]
    assert scaler["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": f"{FULLNAME}-worker",
    }
    if expected == "HorizontalPodAutoscaler":
        names = {m["external"]["metric"]["name"] for m in scaler["spec"]["metrics"]}
        assert "orchestrator_queue_depth" in names
        behavior = scaler["spec"]["behavior"]
    else:
        redis = [t for t in scaler["spec"]["triggers"] if t["type"] == "redis"]
        assert redis[0]["metadata"]["listName"].startswith("orch.")
        assert redis[0]["metadata"]["listName"].endswith(".shared")
        behavior = scaler["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    # Removing a worker ends its rollouts: at most one pod per period on the way down.
    assert behavior["scaleDown"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 300}]


def test_worker_metrics_port_is_served_and_scraped(rendered: Objects) -> None:
    objects = rendered["production"]
    worker = find(objects, "StatefulSet", f"{FULLNAME}-worker")
    ports = worker["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert ports == [{"name": "metrics", "containerPort": 9109, "protocol": "TCP"}]
    service = find(objects, "Service", f"{FULLNAME}-worker")
    assert service["spec"]["clusterIP"] == "None"
    assert worker["spec"]["serviceName"] == service["metadata"]["name"]
    config = find(objects, "ConfigMap", f"{FULLNAME}-config")["data"]
    assert config["ORCH_WORKER_METRICS_PORT"] == "9109"


def test_reaper_metrics_port_is_served_and_scraped(rendered: Objects) -> None:
    """The reaper counts what it reaps in its own process: a port, a headless Service, a
    ServiceMonitor and a policy that lets only the scraper in."""
    objects = rendered["production"]
    reaper = find(objects, "Deployment", f"{FULLNAME}-reaper")
    ports = reaper["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert ports == [{"name": "metrics", "containerPort": 9110, "protocol": "TCP"}]
    service = find(objects, "Service", f"{FULLNAME}-reaper")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["ports"][0]["port"] == 9110
    config = find(objects, "ConfigMap", f"{FULLNAME}-config")["data"]
    assert config["ORCH_REAPER_METRICS_PORT"] == "9110"
    monitor = find(objects, "ServiceMonitor", f"{FULLNAME}-reaper")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    policy = find(objects, "NetworkPolicy", f"{FULLNAME}-reaper")
    [ingress] = policy["spec"]["ingress"]
    assert ingress["ports"] == [{"protocol": "TCP", "port": 9110}]


def api_services(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every Service whose selector picks the API's pods, by name."""
    api = find(objects, "Deployment", f"{FULLNAME}-api")
    labels = api["spec"]["template"]["metadata"]["labels"]
    return {
        o["metadata"]["name"]: o
        for o in objects
        if o["kind"] == "Service"
        and o["spec"].get("selector")
        and o["spec"]["selector"].items() <= labels.items()
    }


def test_api_metrics_port_is_scraped_apart_from_the_trainers_port(rendered: Objects) -> None:
    """api.metricsPort: /metrics without a token on a port of the API container's own,
    behind a headless Service of its own and never the API's Service (which may be a
    LoadBalancer), scraped by the ServiceMonitor with no credential; the NetworkPolicy
    lets networkPolicy.apiFrom in to 8000 and networkPolicy.metricsFrom to that port."""
    objects = rendered["production"]
    api = find(objects, "Deployment", f"{FULLNAME}-api")
    [container] = api["spec"]["template"]["spec"]["containers"]
    assert container["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 9111, "protocol": "TCP"},
    ]
    env = {v["name"]: v.get("value") for v in container["env"]}
    assert env["ORCH_API_METRICS_PORT"] == "9111"
    assert env["ORCH_API_METRICS_HOST"] == "0.0.0.0"
    services = api_services(objects)
    assert set(services) == {f"{FULLNAME}-api", f"{FULLNAME}-api-metrics"}
    main = services[f"{FULLNAME}-api"]["spec"]
    assert main["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    scraped = services[f"{FULLNAME}-api-metrics"]
    assert scraped["spec"]["clusterIP"] == "None"
    assert scraped["spec"]["ports"] == [
        {"name": "metrics", "port": 9111, "targetPort": "metrics", "protocol": "TCP"}
    ]
    monitor = find(objects, "ServiceMonitor", f"{FULLNAME}-api")
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "30s"}
    ]
    # It selects both Services; only the headless one has the port it names.
    selector = monitor["spec"]["selector"]["matchLabels"]
    with_port = [
        name
        for name, service in services.items()
        if selector.items() <= service["metadata"]["labels"].items()
        and "metrics" in {p["name"] for p in service["spec"]["ports"]}
    ]
    assert with_port == [f"{FULLNAME}-api-metrics"]
    peers = yaml.safe_load(PRODUCTION.read_text())["networkPolicy"]
    policy = find(objects, "NetworkPolicy", f"{FULLNAME}-api")
    assert policy["spec"]["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": 8000}], "from": peers["apiFrom"]},
        {"ports": [{"protocol": "TCP", "port": 9111}], "from": peers["metricsFrom"]},
    ]
    # Empty lists (the defaults): each port from anyone.
    open_policy = find(rendered["default"], "NetworkPolicy", f"{FULLNAME}-api")
    assert open_policy["spec"]["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": 8000}]},
        {"ports": [{"protocol": "TCP", "port": 9111}]},
    ]


def test_api_metrics_port_zero_leaves_only_the_api_port(helm: Helm) -> None:
    """api.metricsPort: 0: no listener, container port, Service, ServiceMonitor or policy
    rule for it; /metrics is then the operator's, on the API's port, and nothing scrapes
    it (the workers' and the reaper's ServiceMonitors stay)."""
    objects = helm.render("-f", str(PRODUCTION), "--set", "api.metricsPort=0")
    api = find(objects, "Deployment", f"{FULLNAME}-api")
    [container] = api["spec"]["template"]["spec"]["containers"]
    assert [p["name"] for p in container["ports"]] == ["http"]
    assert not {v["name"] for v in container["env"]} & {
        "ORCH_API_METRICS_PORT",
        "ORCH_API_METRICS_HOST",
    }
    assert set(api_services(objects)) == {f"{FULLNAME}-api"}
    monitors = {o["metadata"]["name"] for o in objects if o["kind"] == "ServiceMonitor"}
    assert monitors == {f"{FULLNAME}-worker", f"{FULLNAME}-reaper"}
    peers = yaml.safe_load(PRODUCTION.read_text())["networkPolicy"]
    policy = find(objects, "NetworkPolicy", f"{FULLNAME}-api")
    assert policy["spec"]["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": 8000}], "from": peers["apiFrom"]}
    ]
