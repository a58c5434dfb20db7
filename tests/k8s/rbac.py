"""The worker's identity on the real control plane: the ServiceAccount, Role and
RoleBinding exactly as ``helm template`` renders them from the chart (never hand-copied),
applied by an administrator, and the account's token as the token controller issued it.

A backend given ``worker_kubeconfig`` talks to the API server as the chart's worker does in
a cluster, so a verb the Role lacks fails its test with the API server's 403, and the audit
log shows every verb the worker used (``tests/k8s/test_rbac.py`` compares the two).
"""

from __future__ import annotations

import base64
import time
from typing import Any

from tests.chart import conftest as chart

Obj = dict[str, Any]

RELEASE_NAMESPACE = chart.NAMESPACE
SANDBOX_NAMESPACE = "orchestrator-sandboxes"
WORKER_KINDS = ("ServiceAccount", "Role", "RoleBinding")
TOKEN_TIMEOUT_S = 30.0
PLURALS = {"ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings"}


def chart_objects() -> list[Obj]:
    """Every object the chart renders with its default values."""
    return chart.Helm(chart.helm_binary()).render()


def worker_objects(objects: list[Obj] | None = None) -> list[Obj]:
    """The worker's ServiceAccount and the Role and RoleBinding that let it manage sandboxes,
    as rendered (the API and beat's account is not the worker's: it mounts no token)."""
    rendered = chart_objects() if objects is None else objects
    found = [
        o
        for o in rendered
        if o["kind"] in WORKER_KINDS
        and o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "worker"
    ]
    kinds = sorted(o["kind"] for o in found)
    assert kinds == sorted(WORKER_KINDS), f"the chart's worker RBAC changed shape: {kinds}"
    return found


def object_path(obj: Obj) -> str:
    """Where an object of ``worker_objects`` is created (its namespace, else the release's)."""
    namespace = obj["metadata"].get("namespace") or RELEASE_NAMESPACE
    group = "/api/v1" if obj["apiVersion"] == "v1" else f"/apis/{obj['apiVersion']}"
    return f"{group}/namespaces/{namespace}/{PLURALS[obj['kind']]}"


def service_account(objects: list[Obj]) -> tuple[str, str]:
    """(namespace, name) of the worker's ServiceAccount."""
    account = next(o for o in objects if o["kind"] == "ServiceAccount")
    return account["metadata"].get("namespace") or RELEASE_NAMESPACE, account["metadata"]["name"]


def username(objects: list[Obj]) -> str:
    """The user the API server sees for the worker's token (as the audit log names it)."""
    namespace, name = service_account(objects)
    return f"system:serviceaccount:{namespace}:{name}"


def apply_worker_rbac(admin: Any) -> tuple[str, str]:
    """Create the chart's worker RBAC through ``admin`` (a cluster.Api) and wait for the
    token controller to issue the account's token. Returns (user name, token)."""
    objects = worker_objects()
    for obj in objects:
        body = {k: v for k, v in obj.items()}
        admin.request("POST", object_path(obj), body)
    namespace, name = service_account(objects)
    deadline = time.monotonic() + TOKEN_TIMEOUT_S
    while True:
        account = admin.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}")
        secrets = (account or {}).get("secrets") or []
        if secrets:
            secret = admin.get(f"/api/v1/namespaces/{namespace}/secrets/{secrets[0]['name']}")
            token = ((secret or {}).get("data") or {}).get("token")
            if token:
                return username(objects), base64.b64decode(token).decode()
        assert time.monotonic() < deadline, f"no token for {namespace}/{name}"
        time.sleep(0.1)
