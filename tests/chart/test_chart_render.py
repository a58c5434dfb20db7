"""The chart with the real helm: lint, render, validate every object offline.

Built-in kinds are validated by kubernetes-validate (strict: unknown fields are errors)
against the oldest Kubernetes the chart supports (1.30) and the newest the package knows;
the custom resources against the hand-written schemas of crd_schemas.py.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import kubernetes_validate.utils as kv_utils  # type: ignore[import-untyped]
import pytest
import yaml

from orchestrator.api import agent_rft, health
from orchestrator.config import Settings
from orchestrator.images.codebases import codebase_image
from orchestrator.tenants import parse_tenants
from tests.chart.conftest import (
    CHART,
    FULLNAME,
    NAMESPACE,
    PRODUCTION,
    SCENARIOS,
    TENANTS_FILE,
    Helm,
    find,
    pod_specs,
)
from tests.chart.crd_schemas import BY_KIND, TRIGGER_REQUIRED

pytestmark = pytest.mark.xdist_group("chart")

KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())


@pytest.fixture(scope="module", autouse=True)
def schemas_parsed_once() -> Iterator[None]:
    """kubernetes-validate parses its schema files again for every object it validates,
    its definitions (megabytes of JSON) included: 18 s of CPU for this module's objects.
    Parsed once each here; the schemas are only read, never changed."""
    patch = pytest.MonkeyPatch()
    patch.setattr(kv_utils, "schema_contents", functools.cache(kv_utils.schema_contents))
    yield
    patch.undo()


def test_helm_is_v4(helm: Helm) -> None:
    done = helm.run("version", "--template", "{{.Version}}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("v4."), done.stdout


@pytest.mark.parametrize("values", [[], ["-f", str(PRODUCTION)]], ids=["default", "production"])
def test_lint_strict_passes(helm: Helm, values: list[str]) -> None:
    done = helm.lint(*values)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_object_validates_offline(
    rendered: dict[str, list[dict[str, Any]]], scenario: str
) -> None:
    objects = rendered[scenario]
    assert objects
    for obj in objects:
        where = f"{scenario}: {obj['kind']}/{obj['metadata']['name']}"
        schema = BY_KIND.get(obj["kind"])
        if schema is not None:
            jsonschema.validate(obj, schema)
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{where} is invalid for Kubernetes {version}: {exc.message}")


def test_validation_rejects_a_misspelt_field(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Strict validation is not vacuous: a rendered Deployment with one misspelt field fails."""
    api = find(rendered["default"], "Deployment", f"{FULLNAME}-api")
    broken = {**api, "spec": {**api["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


def test_custom_resource_schemas_reject_what_the_cluster_would() -> None:
    """The hand-written schemas are not vacuous: a misspelt field and a missing target fail."""
    scaled = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "w"},
        "spec": {"scaleTargetRef": {"name": "w"}, "triggers": [{"type": "redis", "metadata": {}}]},
    }
    jsonschema.validate(scaled, BY_KIND["ScaledObject"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**scaled, "spec": {"triggers": []}}, BY_KIND["ScaledObject"])
    monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "m"},
        "spec": {"selector": {"matchLabels": {}}, "endpoints": [{"port": "http", "pth": "/m"}]},
    }
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, BY_KIND["ServiceMonitor"])


@pytest.mark.parametrize("scenario", ["keda-bundled-redis", "production"])
def test_keda_triggers_carry_their_required_parameters(
    rendered: dict[str, list[dict[str, Any]]], scenario: str
) -> None:
    scaled = find(rendered[scenario], "ScaledObject")
    for trigger in scaled["spec"]["triggers"]:
        assert TRIGGER_REQUIRED[trigger["type"]] <= set(trigger["metadata"]), trigger
        if "authenticationRef" in trigger:
            find(rendered[scenario], "TriggerAuthentication", trigger["authenticationRef"]["name"])


@pytest.mark.parametrize(
    ("values", "mentions"),
    [
        (["--set", "api.replicaz=3"], "replicaz"),
        (["--set", "settings.host_max_sandboxez=10"], "host_max_sandboxez"),
        (["--set", "settings.redis_url=redis://elsewhere:6379/0"], "redis_url"),
        (["--set", "autoscaling.mode=kubernetes"], "autoscaling"),
        (["--set", "deployment=Not_Valid"], "deployment"),
        (["--set", "worker.resources.limits=null"], "limits"),
        (["--set", "api.metricsPort=65536"], "metricsPort"),
        (["--set", "settings.tenants_file=/etc/t.yaml"], "tenants_file"),
        (["--set", "tenants.files.a=b"], "files"),
    ],
    ids=[
        "typo",
        "unknown-setting",
        "derived-setting",
        "bad-enum",
        "bad-pattern",
        "no-limits",
        "port-range",
        "derived-tenants-file",
        "tenants-typo",
    ],
)
def test_values_schema_rejects(helm: Helm, values: list[str], mentions: str) -> None:
    for done in (helm.lint(*values), helm.template(*values)):
        assert done.returncode != 0, f"accepted {values}"
        assert mentions in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("values", "mentions"),
    [
        (["--set", "redis.mode=external"], "redis.external.url"),
        (
            [
                *("--set", "redis.mode=external"),
                *("--set", "redis.external.url=redis://r:6379/0"),
                *("--set", "autoscaling.mode=keda"),
            ],
            "autoscaling.keda.redis.address",
        ),
        (["--set", "ingress.tls.enabled=true"], "ingress.tls.secretName"),
        (["--set", f"sandboxes.namespace={NAMESPACE}"], "sandboxes.namespace"),
        (
            ["--set", "autoscaling.minReplicas=5", "--set", "autoscaling.maxReplicas=2"],
            "minReplicas",
        ),
        (
            ["--set", "tenants.existingSecret=mine", "--set", "tenants.file.tenants.a.admin=true"],
            "tenants.existingSecret",
        ),
        (["--set", "api.metricsPort=8000"], "api.metricsPort"),
    ],
    ids=[
        "external-redis-no-url",
        "keda-external-no-address",
        "tls-no-secret",
        "same-ns",
        "min>max",
        "tenants-two-ways",
        "metrics-on-api-port",
    ],
)
def test_inconsistent_values_fail_with_a_reason(
    helm: Helm, values: list[str], mentions: str
) -> None:
    done = helm.template(*values)
    assert done.returncode != 0
    assert mentions in done.stderr


def test_schema_settings_are_real_settings() -> None:
    """Every setting the values schema accepts is a field of the one Settings object, with
    the same type, and the settings the chart derives itself are not accepted."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    accepted = schema["properties"]["settings"]["properties"]
    fields = Settings.model_json_schema()["properties"]
    assert set(accepted) <= set(fields), set(accepted) - set(fields)
    for name, rule in accepted.items():
        assert rule.get("type") == fields[name].get("type"), name
        assert rule.get("enum") == fields[name].get("enum"), name
    derived = {
        "deployment",
        "redis_url",
        "api_tokens",
        "api_metrics_port",
        "api_metrics_host",
        "tenants_file",
        "sandbox_backend",
        "k8s_namespace",
    }
    assert not derived & set(accepted)


@pytest.mark.parametrize("scenario", ["default", "production", "tenants"])
def test_config_map_is_read_by_the_real_settings(
    rendered: dict[str, list[dict[str, Any]]], scenario: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ConfigMap's ORCH_* variables, and those the API container sets itself, are
    real settings and parse (JSON maps included), as the API process sees them."""
    data = find(rendered[scenario], "ConfigMap", f"{FULLNAME}-config")["data"]
    api = find(rendered[scenario], "Deployment", f"{FULLNAME}-api")
    [container] = api["spec"]["template"]["spec"]["containers"]
    own = {v["name"]: v["value"] for v in container["env"] if "value" in v}
    fields = set(Settings.model_fields)
    unknown = {k for k in {**data, **own} if k.removeprefix("ORCH_").lower() not in fields}
    assert not unknown, f"not settings: {unknown}"
    for key in [k for k in os.environ if k.startswith("ORCH_")]:
        monkeypatch.delenv(key)
    for key, value in {**data, **own}.items():
        monkeypatch.setenv(key, value)
    parsed = Settings()
    # The scraper reaches the API's metrics listener from outside the pod.
    assert (parsed.api_metrics_port, parsed.api_metrics_host) == (9111, "0.0.0.0")
    assert (parsed.tenants_file is not None) == (scenario == "tenants")
    assert parsed.sandbox_backend == "kubernetes"
    assert parsed.k8s_runtime_classes["runsc"] == "gvisor"
    assert parsed.api_host == "0.0.0.0"
    assert parsed.worker_metrics_host == "0.0.0.0"
    assert parsed.log_format == "json"
    # The API must not give up on a pod before its worker does.
    creating = parsed.k8s_pending_timeout_s + parsed.sandbox_start_timeout_s
    assert parsed.sandbox_create_timeout_s >= creating


def test_environments_are_mounted_where_the_setting_points(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["monitoring-and-environments"]
    data = find(objects, "ConfigMap", f"{FULLNAME}-config")["data"]
    envs = find(objects, "ConfigMap", f"{FULLNAME}-environments")["data"]
    assert yaml.safe_load(envs["environments.yaml"])["environments"][0]["name"] == "e"
    path = data["ORCH_ENVIRONMENTS_FILE"]
    for kind, name in [("Deployment", "api"), ("StatefulSet", "worker"), ("Deployment", "reaper")]:
        pod = find(objects, kind, f"{FULLNAME}-{name}")["spec"]["template"]["spec"]
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert path == f"{mounts['environments']}/environments.yaml"


def test_the_codebase_catalogue_is_mounted_and_read_by_the_real_loader(
    helm: Helm, tmp_path: Path
) -> None:
    """On Kubernetes codebases come from the chart's `codebases` value, not a daemon."""
    ref = "orchestrator/codebase@sha256:" + "ab" * 32
    objects = helm.render("--set-json", json.dumps({"requests": ref}).join(["codebases=", ""]))
    data = find(objects, "ConfigMap", f"{FULLNAME}-config")["data"]
    catalogue = find(objects, "ConfigMap", f"{FULLNAME}-codebases")["data"]["codebases.yaml"]
    path = data["ORCH_CODEBASES_FILE"]
    for kind, name in [("Deployment", "api"), ("StatefulSet", "worker"), ("Deployment", "reaper")]:
        pod = find(objects, kind, f"{FULLNAME}-{name}")["spec"]["template"]["spec"]
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert path == f"{mounts['codebases']}/codebases.yaml"
    local = tmp_path / "codebases.yaml"
    local.write_text(catalogue)
    assert codebase_image(Settings(codebases_file=local), "requests") == ref


def test_prometheus_rule_holds_the_alert_file_with_runbook_links(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    source = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())["groups"]
    rule = find(rendered["monitoring-and-environments"], "PrometheusRule")
    groups = rule["spec"]["groups"]
    assert [g["name"] for g in groups] == [g["name"] for g in source]
    alerts = [r for g in groups for r in g["rules"] if "alert" in r]
    assert alerts
    for alert in alerts:
        assert alert["annotations"]["runbook_url"] == (
            f"https://runbooks.example.com/orch/{alert['alert']}.md"
        )
    # Without a base URL the file's own links stay.
    production = find(rendered["production"], "PrometheusRule")["spec"]["groups"]
    assert production == source


def test_dashboard_config_map_is_the_dashboard_file(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    cm = find(rendered["production"], "ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    source = json.loads((CHART / "files" / "dashboard.json").read_text())
    assert json.loads(cm["data"]["orchestrator.json"]) == source


def test_monitoring_objects_are_off_by_default(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    default = {o["kind"] for o in rendered["default"]}
    assert not {"ServiceMonitor", "PrometheusRule", "ScaledObject"} & default
    production = [o for o in rendered["production"] if o["kind"] == "ServiceMonitor"]
    assert len(production) == 3
    # The API's too: on its metrics port, which needs no token, not on its http port.
    assert {o["spec"]["endpoints"][0]["port"] for o in production} == {"metrics"}


def agent_rft_paths() -> set[str]:
    return {getattr(route, "path", "") for route in agent_rft.router.routes}


def test_notes_print_the_tool_and_grader_urls_the_api_serves(helm: Helm) -> None:
    assert {"/agent-rft/tools", "/agent-rft/grade"} <= agent_rft_paths()
    inside = helm.notes()
    base = f"http://{FULLNAME}-api.{NAMESPACE}.svc:80"
    assert f"tool URL:    {base}/agent-rft/tools" in inside
    assert f"grader URL:  {base}/agent-rft/grade" in inside
    assert "port-forward" in inside
    public = helm.notes("-f", str(PRODUCTION))
    assert "tool URL:    https://orchestrator.example.com/agent-rft/tools" in public
    assert "grader URL:  https://orchestrator.example.com/agent-rft/grade" in public
    # The token command reads the Secret and key the API's ORCH_API_TOKENS comes from.
    assert "get secret orchestrator-api-tokens" in public
    assert "{.data.api-tokens}" in public
    # /readyz is open and says ready or not; the reasons are the operator's.
    health_paths = {getattr(route, "path", "") for route in health.router.routes}
    assert {"/readyz", "/v1/readiness"} <= health_paths
    assert "curl -s http://127.0.0.1:8000/readyz" in inside
    assert 'Bearer TOKEN" http://127.0.0.1:8000/v1/readiness' in inside


def test_ingress_routes_only_the_trainer_endpoints(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    ingress = find(rendered["ingress-tls"], "Ingress")
    paths = {p["path"] for p in ingress["spec"]["rules"][0]["http"]["paths"]}
    assert paths == {"/agent-rft", "/v1"}
    assert ingress["spec"]["tls"][0]["secretName"] == "orchestrator-tls"


def test_kubernetes_doc_names_only_real_settings() -> None:
    doc = (CHART.parents[1] / "docs" / "kubernetes.md").read_text()
    named = {m.removeprefix("ORCH_").lower() for m in re.findall(r"ORCH_[A-Z0-9_]+", doc)}
    assert named
    assert named <= set(Settings.model_fields), named - set(Settings.model_fields)


def secret_refs(objects: list[dict[str, Any]], variable: str) -> dict[str, Any]:
    """Each workload giving its containers ``variable``: its Secret reference (a literal
    value fails: secrets go by reference)."""
    found = {}
    for obj in objects:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in obj["spec"]["template"]["spec"]["containers"]:
            for var in container.get("env", []):
                if var["name"] == variable:
                    assert "value" not in var, var
                    found[obj["metadata"]["name"]] = var["valueFrom"]["secretKeyRef"]
    return found


def test_the_headerless_grader_secret_reaches_the_api_only(helm: Helm) -> None:
    """graderUrlSecret.enabled: a kept random secret in the chart's Secret, given to the API
    alone as ORCH_GRADER_URL_SECRET, long enough for the real Settings; NOTES say how to
    read it. Off by default: no such variable anywhere."""

    def grader_env(objects: list[dict[str, Any]]) -> dict[str, Any]:
        return secret_refs(objects, "ORCH_GRADER_URL_SECRET")

    assert grader_env(helm.render()) == {}
    objects = helm.render("--set", "graderUrlSecret.enabled=true")
    refs = grader_env(objects)
    assert set(refs) == {f"{FULLNAME}-api"}, refs
    secret = next(
        o
        for o in objects
        if o["kind"] == "Secret" and o["metadata"]["name"] == refs[f"{FULLNAME}-api"]["name"]
    )
    value = secret["stringData"][refs[f"{FULLNAME}-api"]["key"]]
    assert Settings(grader_url_secret=value).grader_url_secret == value
    notes = helm.notes("--set", "graderUrlSecret.enabled=true")
    assert "/agent-rft/grade/SECRET" in notes and "{.data.grader-url-secret}" in notes
    own = helm.render(
        "--set", "graderUrlSecret.enabled=true", "--set", "graderUrlSecret.existingSecret=mine"
    )
    assert grader_env(own)[f"{FULLNAME}-api"]["name"] == "mine"


def test_the_graders_secret_variables_reach_the_api_only_by_reference(helm: Helm) -> None:
    """graderSecretEnv: a judge's key from a Secret the operator made, given to the API (where
    grades run) as a secretKeyRef, to no other process; a malformed entry fails the install."""
    objects = helm.render(
        "--set", "graderSecretEnv[0].name=OPENAI_API_KEY",
        "--set", "graderSecretEnv[0].secret=judge-credentials",
        "--set", "graderSecretEnv[0].key=api-key",
    )  # fmt: skip
    refs = secret_refs(objects, "OPENAI_API_KEY")
    assert refs == {f"{FULLNAME}-api": {"name": "judge-credentials", "key": "api-key"}}
    bad = helm.template("--set", "graderSecretEnv[0].name=not a name")
    assert bad.returncode != 0 and "graderSecretEnv" in bad.stderr


def tenants_volume(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The pod's volume of the tenants file (a Secret's, holding it as tenants.yaml)."""
    found = [
        v
        for v in pod.get("volumes", [])
        if any(i["path"] == "tenants.yaml" for i in v.get("secret", {}).get("items", []))
    ]
    assert len(found) <= 1, found
    return found[0] if found else None


def test_the_tenants_file_reaches_the_api_alone_as_a_directory_it_rereads(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """tenants.file: held by the chart's Secret, mounted into the API alone as a directory.
    Not a subPath: the kubelet replaces a mounted Secret's files when the Secret changes
    only for a whole volume, and the API reads the file again when it changes, so tokens
    are added and revoked with no restart. ORCH_TENANTS_FILE names the file in that
    directory, and the real loader reads what the Secret holds."""
    objects = rendered["tenants"]
    api = f"Deployment/{FULLNAME}-api"
    pods = pod_specs(objects)
    volume = tenants_volume(pods[api])
    assert volume is not None
    assert volume["secret"]["items"] == [{"key": "tenants.yaml", "path": "tenants.yaml"}]
    [container] = pods[api]["containers"]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert not {"subPath", "subPathExpr"} & set(mount), mount
    assert mount["readOnly"] is True
    env = {v["name"]: v for v in container["env"]}
    assert env["ORCH_TENANTS_FILE"]["value"] == f"{mount['mountPath']}/tenants.yaml"
    secret = find(objects, "Secret", volume["secret"]["secretName"])
    text = secret["stringData"]["tenants.yaml"]
    assert yaml.safe_load(text) == TENANTS_FILE
    parsed = parse_tenants(text)
    assert parsed.tenants["team-a"].tokens == TENANTS_FILE["tenants"]["team-a"]["tokens"]
    assert parsed.tenants["team-a"].quotas.sandboxes == 4
    # The worker, the reaper and every other pod: neither the file nor the variable.
    for workload, pod in pods.items():
        if workload == api:
            continue
        assert tenants_volume(pod) is None, workload
        for each in pod["containers"] + pod.get("initContainers", []):
            assert "ORCH_TENANTS_FILE" not in {v["name"] for v in each.get("env", [])}, workload
    # Without a tenants file: no such volume or variable anywhere.
    for pod in pod_specs(rendered["default"]).values():
        assert tenants_volume(pod) is None
        for each in pod["containers"]:
            assert "ORCH_TENANTS_FILE" not in {v["name"] for v in each.get("env", [])}


def test_a_tenants_secret_of_ones_own_is_mounted_the_same_way(helm: Helm) -> None:
    objects = helm.render(
        "--set", "tenants.existingSecret=team-tokens", "--set", "tenants.existingSecretKey=t.yaml"
    )
    pods = pod_specs(objects)
    volume = tenants_volume(pods[f"Deployment/{FULLNAME}-api"])
    assert volume is not None
    assert volume["secret"] == {
        "secretName": "team-tokens",
        "items": [{"key": "t.yaml", "path": "tenants.yaml"}],
    }
    chart_secret = find(objects, "Secret", f"{FULLNAME}-secrets")
    assert "t.yaml" not in chart_secret["stringData"]
    assert [w for w, pod in pods.items() if tenants_volume(pod)] == [f"Deployment/{FULLNAME}-api"]


def test_editing_the_tenants_file_rolls_no_pod(
    helm: Helm, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    """Tokens added and revoked by `helm upgrade` change the Secret alone: the pod templates
    (their config checksum included) are the same whatever the tenants file holds, so no
    pod restarts; the mounted file changes under the running API."""
    more = {"tenants": {**TENANTS_FILE["tenants"], "team-b": {"tokens": ["sha256:" + "cd" * 32]}}}
    before = rendered["tenants"]
    after = helm.render("--set-json", f"tenants.file={json.dumps(more)}")
    for kind, name in [("Deployment", "api"), ("StatefulSet", "worker"), ("Deployment", "reaper")]:
        old = find(before, kind, f"{FULLNAME}-{name}")["spec"]["template"]
        new = find(after, kind, f"{FULLNAME}-{name}")["spec"]["template"]
        assert old == new, name
        # Nor is the checksum the tenants file's at all: the same as with none.
        none = find(rendered["default"], kind, f"{FULLNAME}-{name}")["spec"]["template"]
        checksum = "checksum/config"
        assert new["metadata"]["annotations"][checksum] == none["metadata"]["annotations"][checksum]
    changed = find(after, "Secret", f"{FULLNAME}-secrets")["stringData"]["tenants.yaml"]
    assert set(parse_tenants(changed).tenants) == {"team-a", "team-b"}
