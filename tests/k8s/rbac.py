"""The worker's identity on the real control plane: the ServiceAccount, Role and
RoleBinding exactly as ``helm template`` renders them from the chart (never hand-copied),
applied by an administrator, and the account's token as the token controller issued it.

A backend given a kubeconfig of this account talks to the API server as the chart's worker does in
a cluster, so a verb the Role lacks fails its test with the API server's 403, and the audit
log shows every verb the worker used (``tests/k8s/test_rbac.py`` compares the two).
"""

from __future__ import annotations

import base64
import copy
import time
from typing import Any, NamedTuple

from tests.chart import conftest as chart

Obj = dict[str, Any]

RELEASE_NAMESPACE = chart.NAMESPACE
SANDBOX_NAMESPACE = "orchestrator-sandboxes"
WORKER_KINDS = ("ServiceAccount", "Role", "RoleBinding")
TOKEN_TIMEOUT_S = 30.0
# How long a changed Role may take to reach the API server's authorizer (its informer).
RBAC_PROPAGATION_S = 10.0
PLURALS = {"ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings"}


class Grant(NamedTuple):
    """One verb on one resource of one API group, as a Role grants it and as the audit log
    names a request (``resource`` is ``pods`` or ``pods/status``)."""

    group: str
    resource: str
    verb: str

    def __str__(self) -> str:
        where = f"{self.group}/{self.resource}" if self.group else self.resource
        return f"{where} {self.verb}"


def chart_objects() -> list[Obj]:
    """Every object the chart renders with its default values."""
    return chart.Helm(chart.helm_binary()).render()


def worker_objects(objects: list[Obj] | None = None) -> list[Obj]:
    """The worker's ServiceAccount and the Role and RoleBinding that let it manage sandboxes,
    as rendered (the API and the reaper's account is not the worker's: it mounts no token)."""
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


def worker_role(objects: list[Obj] | None = None) -> Obj:
    """The worker's Role, as the chart renders it."""
    return next(o for o in worker_objects(objects) if o["kind"] == "Role")


def grants(role: Obj) -> set[Grant]:
    """Every (group, resource, verb) the Role grants. Only plain rules are understood: a
    wildcard or a rule narrowed to some objects by name would make a set of triples a lie,
    so either fails here rather than being read as something it is not."""
    found: set[Grant] = set()
    for rule in role.get("rules") or []:
        assert not rule.get("resourceNames"), f"a rule narrowed by name: {rule}"
        assert not rule.get("nonResourceURLs"), f"a non-resource rule in a Role: {rule}"
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"a wildcard grant: {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                found |= {Grant(group, resource, verb) for verb in rule["verbs"]}
    return found


def without(role: Obj, grant: Grant) -> Obj:
    """A copy of the Role that grants everything it does but ``grant``: the rule holding
    it is split, so the other resources and groups of that rule keep every verb."""
    cut = copy.deepcopy(role)
    rules: list[Obj] = []
    for rule in role["rules"]:
        if grant.group not in rule["apiGroups"] or grant.resource not in rule["resources"]:
            rules.append(copy.deepcopy(rule))
            continue
        others = [g for g in rule["apiGroups"] if g != grant.group]
        if others:
            rules.append({**copy.deepcopy(rule), "apiGroups": others})
        rest = [r for r in rule["resources"] if r != grant.resource]
        if rest:
            rules.append({**copy.deepcopy(rule), "apiGroups": [grant.group], "resources": rest})
        verbs = [v for v in rule["verbs"] if v != grant.verb]
        if verbs:  # a rule without verbs is invalid
            rules.append(
                {"apiGroups": [grant.group], "resources": [grant.resource], "verbs": verbs}
            )
    cut["rules"] = rules
    assert grants(cut) == grants(role) - {grant}
    return cut


def role_path(role: Obj) -> str:
    return f"{object_path(role)}/{role['metadata']['name']}"


def replace_role(admin: Any, role: Obj) -> None:
    """PUT ``role`` (a version of the worker's Role) in place of the one on the server."""
    path = role_path(role)
    current = admin.request("GET", path)
    body = copy.deepcopy(role)
    body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
    admin.request("PUT", path, body)


def allowed(admin: Any, objects: list[Obj], grant: Grant) -> bool:
    """Whether the API server's authorizer lets the worker's account do ``grant`` in the
    sandbox namespace now (a SubjectAccessReview, asked as the administrator, so the
    worker's own audit trail holds only what the backend did)."""
    namespace, _ = service_account(objects)
    resource, _, subresource = grant.resource.partition("/")
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": username(objects),
            # The groups the API server gives a ServiceAccount's token.
            "groups": [
                "system:serviceaccounts",
                f"system:serviceaccounts:{namespace}",
                "system:authenticated",
            ],
            "resourceAttributes": {
                "namespace": worker_role(objects)["metadata"]["namespace"],
                "group": grant.group,
                "resource": resource,
                "subresource": subresource,
                "verb": grant.verb,
            },
        },
    }
    found = admin.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", review)
    return bool(found["status"].get("allowed"))


def wait_authorized(admin: Any, objects: list[Obj], role: Obj, *, everything: set[Grant]) -> int:
    """Until the authorizer judges as ``role`` says, for each of ``everything``: allowed
    what it grants, refused the rest. Returns how many rounds of reviews that took (1: the
    change was in effect by the first look)."""
    granted = grants(role)
    deadline = time.monotonic() + RBAC_PROPAGATION_S
    rounds = 0
    while True:
        rounds += 1
        wrong = sorted(str(g) for g in everything if allowed(admin, objects, g) != (g in granted))
        if not wrong:
            return rounds
        assert time.monotonic() < deadline, f"the authorizer still judges by the old Role: {wrong}"
        time.sleep(0.05)
