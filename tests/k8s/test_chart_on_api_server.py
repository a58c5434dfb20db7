"""Every object the chart renders, in every scenario, sent to a real API server
(kube-apiserver 1.20.2, tests/k8s/control_plane.py) with a server-side dry run: schema
validation and admission of a real server, except the kinds listed here as not served by
1.20 or backed by CRDs that are not installed. (What the chart's worker Role allows is
test_rbac.py's, on a real node; the chart installed for real is test_helm_install.py's.)
"""

from __future__ import annotations

import base64
import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any

from tests.chart.conftest import NAMESPACE as RELEASE_NAMESPACE
from tests.chart.conftest import SCENARIOS, Helm, helm_binary
from tests.k8s.cluster import Api, ApiError
from tests.k8s.control_plane import ControlPlane

Obj = dict[str, Any]

# apiVersions the chart renders that Kubernetes 1.20 does not serve (the chart asks for
# 1.30 or later: Chart.yaml's kubeVersion), each with the version 1.20 serves the kind at.
# The objects are sent at that version instead, so their spec is still checked.
NOT_SERVED_BY_1_20: dict[tuple[str, str], str] = {
    # policy/v1 is served from 1.21 on.
    ("policy/v1", "PodDisruptionBudget"): "policy/v1beta1",
    # autoscaling/v2 is served from 1.23 on (v2beta2 has the same fields the chart uses).
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "autoscaling/v2beta2",
}
# Kinds of operators' CRDs, not installed on this server: not checkable here (checked
# offline against tests/chart/crd_schemas.py by tests/chart/test_chart_render.py).
CRD_KINDS: dict[tuple[str, str], str] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "the Prometheus Operator",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "the Prometheus Operator",
    ("keda.sh/v1alpha1", "ScaledObject"): "KEDA",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): "KEDA",
}


@dataclass
class Discovery:
    """What the API server serves, as its discovery documents say (how helm and kubectl
    map a kind to its collection, and refuse one with "no matches for kind")."""

    api: Api
    found: dict[str, Obj | None] = field(default_factory=dict)

    def resource(self, api_version: str, kind: str) -> Obj | None:
        """The discovery entry of ``kind`` at ``api_version``; None when not served."""
        if api_version not in self.found:
            path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            self.found[api_version] = self.api.get(path)
        served = self.found[api_version] or {}
        return next(
            (
                r
                for r in served.get("resources") or []
                if r["kind"] == kind and "/" not in r["name"]
            ),
            None,
        )

    def collection(self, obj: Obj) -> str:
        entry = self.resource(obj["apiVersion"], obj["kind"])
        assert entry is not None
        base = "/api/v1" if obj["apiVersion"] == "v1" else f"/apis/{obj['apiVersion']}"
        if not entry["namespaced"]:
            return f"{base}/{entry['name']}"
        namespace = obj["metadata"].get("namespace") or RELEASE_NAMESPACE
        return f"{base}/namespaces/{namespace}/{entry['name']}"


def leaves(value: Any, path: str = "") -> set[str]:
    """The paths of a JSON value's scalars. Empty lists and maps count as absent: the API
    server omits them when it writes an object back."""
    if isinstance(value, dict):
        return set().union(*(leaves(v, f"{path}.{k}") for k, v in value.items()))
    if isinstance(value, list):
        return set().union(*(leaves(v, f"{path}[{i}]") for i, v in enumerate(value)))
    return {path}


def as_sent(obj: Obj) -> Obj:
    """What the server should give back at least: a Secret's ``stringData`` is write-only,
    merged into ``data``."""
    sent = copy.deepcopy(obj)
    if sent["kind"] == "Secret" and "stringData" in sent:
        strings = sent.pop("stringData")
        data = sent.setdefault("data", {})
        data.update({k: base64.b64encode(v.encode()).decode() for k, v in strings.items()})
    return sent


def test_every_object_of_the_chart_is_accepted_by_a_real_api_server() -> None:
    # A control plane holding only the release namespace, as before ``helm install``.
    with (
        ControlPlane(namespaces=(RELEASE_NAMESPACE,)) as plane,
        contextlib.closing(Api(plane, "admin")) as admin,
    ):
        check_chart(Helm(helm_binary()), admin)


def check_chart(helm: Helm, admin: Api) -> None:
    discovery = Discovery(admin)
    rendered = {name: helm.render(*values) for name, values in SCENARIOS.items()}
    unknown: set[tuple[str, str]] = set()
    problems: list[str] = []

    def send(scenario: str, obj: Obj) -> None:
        """Create ``obj`` with a dry run: validated and admitted, not stored."""
        where = f"{scenario}: {obj['kind']} {obj['metadata']['name']}"
        try:
            back = admin.request("POST", discovery.collection(obj), obj, dryRun="All")
        except ApiError as exc:
            problems.append(f"{where}: {exc}")
            return
        # 1.20 drops a field it does not know (no strict field validation before 1.25).
        dropped = leaves(as_sent(obj)) - leaves(back)
        if dropped:
            problems.append(f"{where}: fields 1.20 dropped: {sorted(dropped)}")

    # Namespaces first, while the sandbox namespace does not exist yet; then it is made
    # (what helm does first), for the objects in it to be admitted there.
    namespaces = [(s, o) for s, objs in rendered.items() for o in objs if o["kind"] == "Namespace"]
    for scenario, obj in namespaces:
        send(scenario, obj)
    assert namespaces, "the chart renders no Namespace"
    admin.request("POST", "/api/v1/namespaces", namespaces[0][1])

    for scenario, objs in rendered.items():
        for obj in objs:
            kind = (obj["apiVersion"], obj["kind"])
            if obj["kind"] == "Namespace":
                continue
            if discovery.resource(*kind) is not None:
                send(scenario, obj)
                continue
            unknown.add(kind)
            served = NOT_SERVED_BY_1_20.get(kind)
            if served is not None:
                send(scenario, {**obj, "apiVersion": served})
    assert not problems, "\n".join(problems)
    # Exactly the kinds named above are unknown to 1.20: a new one fails here, to be looked
    # at and listed with its reason, not skipped quietly.
    listed = set(NOT_SERVED_BY_1_20) | set(CRD_KINDS)
    assert unknown == listed, f"unknown to 1.20: {sorted(unknown)}; listed: {sorted(listed)}"
    for kind, served in NOT_SERVED_BY_1_20.items():
        assert discovery.resource(served, kind[1]) is not None, (kind, served)
    # A dry run stores nothing: the server holds none of the objects it accepted.
    for obj in rendered["default"]:
        if obj["kind"] != "Namespace" and discovery.resource(obj["apiVersion"], obj["kind"]):
            path = f"{discovery.collection(obj)}/{obj['metadata']['name']}"
            assert admin.get(path) is None, f"a dry run stored {path}"
