"""The chart's RBAC and objects on a real API server (kube-apiserver 1.20.2 with RBAC on,
tests/k8s/control_plane.py), the worker acting through the chart's own ServiceAccount, Role
and RoleBinding (tests/k8s/rbac.py):

1. **Used == granted.** A ``KubernetesBackend`` as the worker does everything a worker
   does; the audit log's (resource, verb) of its requests must be exactly what the rendered
   Role grants, none refused. A grant nothing uses is a standing permission for an
   attacker holding the worker's token, and nothing else.
2. **A missing verb fails.** For each grant, the Role without it (on the same server) makes
   the operation that needs it fail with the API server's 403, as the backend reports it.

The worker's sandboxes are pods of a real node (node.py). That the chart's every object is
accepted by a real API server is test_chart_on_api_server.py's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest

from orchestrator.config import Settings
from orchestrator.sandbox.backend import SandboxError, SandboxHandle
from orchestrator.sandbox.gc import collect_expired
from orchestrator.sandbox.k8s import backend as backend_module
from orchestrator.sandbox.k8s import pods
from orchestrator.sandbox.k8s.backend import KubernetesBackend
from orchestrator.sandbox.k8s.watch import watch_pod
from tests.k8s import rbac
from tests.k8s.cluster import RealCluster
from tests.k8s.control_plane import AuditEntry
from tests.k8s.rbac import SANDBOX_NAMESPACE, Grant
from tests.k8s.test_backend import k8s_settings, spec

pytestmark = pytest.mark.xdist_group("real-node")

Obj = dict[str, Any]

UNPULLABLE = "orchestrator/no-such-image:rbac"
AUDIT_TIMEOUT_S = 30.0
SWEEP_TIMEOUT_S = 15.0
# "At once": well inside the 30 s an authorization webhook caches a refusal by default.
RBAC_AT_ONCE_S = 2.0

# What the Role grants, read from the chart when the tests are collected.
GRANTED = sorted(rbac.grants(rbac.worker_role()))


@pytest.fixture(scope="module")
def cluster(real_cluster: RealCluster) -> RealCluster:
    """The module's cluster (tests/k8s/conftest.py)."""
    return real_cluster


@pytest.fixture(scope="module")
def objects() -> list[Obj]:
    """The chart's worker ServiceAccount, Role and RoleBinding, as rendered."""
    return rbac.worker_objects()


@pytest.fixture(scope="module")
def role(objects: list[Obj]) -> Obj:
    return next(o for o in objects if o["kind"] == "Role")


@pytest.fixture(scope="module")
def worker(settings: Settings, cluster: RealCluster, role: Obj) -> Iterator[KubernetesBackend]:
    with contextlib.ExitStack() as stack:
        backend = as_worker(stack, settings, cluster)
        yield backend
        rbac.replace_role(cluster.api, role)  # each case restores it; a failed one may not
        for handle in backend.list_owned():
            backend.destroy(handle)
        cluster.settle()


@pytest.fixture(scope="module")
def shared(worker: KubernetesBackend, base_image: str) -> Iterator[SandboxHandle]:
    """A healthy sandbox for the operations that act on one without ending it."""
    handle = worker.create(spec(base_image, "rbac-shared"))
    yield handle
    worker.destroy(handle)


def as_worker(
    stack: contextlib.ExitStack, settings: Settings, cluster: RealCluster, **overrides: Any
) -> KubernetesBackend:
    """A backend as the chart's worker, its client closed with ``stack``."""
    client = stack.enter_context(contextlib.closing(cluster.client()))
    return KubernetesBackend(k8s_settings(settings, **overrides), client=client)


def worker_requests(cluster: RealCluster, since: int) -> list[AuditEntry]:
    """The worker's requests among the audit log's entries from index ``since`` on."""
    return [e for e in list(cluster.plane.audit())[since:] if e.user == cluster.worker_user]


def logged(cluster: RealCluster, since: int, *, watches: int) -> list[AuditEntry]:
    """The worker's requests from ``since`` on, once the log holds ``watches`` watches. A
    watch is logged when it ends, and the server notices a moment after the backend closed
    it: until then, the log lacks it (and a count of requests made so far is short)."""
    deadline = time.monotonic() + AUDIT_TIMEOUT_S
    while True:
        entries = worker_requests(cluster, since)
        if sum(e.verb == "watch" for e in entries) >= watches:
            return entries
        assert time.monotonic() < deadline, f"{watches} watches, not all in the audit log"
        time.sleep(0.05)


def grant_of(entry: AuditEntry) -> Grant:
    return Grant(entry.group, entry.resource, entry.verb)


def audit_mark(cluster: RealCluster) -> int:
    return len(list(cluster.plane.audit()))


# -- 1. used == granted ----------------------------------------------------------------------


def test_the_worker_uses_exactly_what_the_role_grants(
    settings: Settings,
    cluster: RealCluster,
    role: Obj,
    base_image: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every path of the backend that talks to the API server, as the worker: create (and
    a failed create, whose evidence is the pod's events), exec and read_file, probe,
    another worker finding the sandbox through the API, list_owned, host_health, the
    leftover sweep of an orphan Secret, a gc pass, destroy."""
    opened: list[int] = []

    def counted_watch(*args: Any, **kw: Any) -> Iterator[Any]:
        opened.append(1)  # on the first next(): when the watch request goes out
        yield from watch_pod(*args, **kw)

    monkeypatch.setattr(backend_module, "watch_pod", counted_watch)
    since = audit_mark(cluster)
    stack = contextlib.ExitStack()
    worker = as_worker(stack, settings, cluster)
    # Shorter-lived than any other sandbox here, so the gc pass below expires it alone.
    handle = worker.create(spec(base_image, "rbac-used").model_copy(update={"lifetime_s": 600}))
    try:
        before = len(logged(cluster, since, watches=len(opened)))
        ran = worker.exec(handle, "echo hi > note", timeout_s=10, output_budget_bytes=64)
        assert ran.exit_code == 0
        assert worker.read_file(handle, "note", max_bytes=64).text == "hi\n"
        assert len(worker_requests(cluster, since)) == before  # tool calls skip the API

        assert worker.probe(handle).agent_ok

        with pytest.raises(SandboxError, match=r"image_pull_failed.*; events: .*Failed"):
            worker.create(spec(UNPULLABLE, "rbac-used-pull"))

        # A worker that did not create the sandbox reads its IP and token from the API.
        other = as_worker(stack, settings, cluster, host_id="worker-b")
        ran = other.exec(handle, "cat note", timeout_s=10, output_budget_bytes=64)
        assert ran.stdout.head == "hi\n"

        assert handle.sandbox_id in {h.sandbox_id for h in worker.list_owned()}
        health = worker.host_health()
        assert health.backend_ok and health.sandboxes >= 1, health

        # A Secret whose pod never came (made by the administrator: the worker's own
        # creates name their pod as owner), swept once it is older than the sweep spares.
        sweeper = as_worker(stack, settings, cluster, sandbox_start_timeout_s=1)
        orphan = pods.pod_name(sweeper.settings, "sbx-orphan00000")
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": orphan, "labels": dict(pods.selector(sweeper.settings))},
        }
        cluster.api.request("POST", f"/api/v1/namespaces/{SANDBOX_NAMESPACE}/secrets", body)
        deadline = time.monotonic() + SWEEP_TIMEOUT_S
        while sweeper.sweep_leftovers() == 0:
            assert time.monotonic() < deadline, "the orphan Secret was never swept"
            time.sleep(0.2)
        assert cluster.read("secrets", orphan) is None

        # A gc pass after the sandbox's lifetime: list_owned, destroy, sweep.
        report = collect_expired(worker, now=handle.expires_at + timedelta(seconds=1))
        assert report.destroyed == [handle.sandbox_id]
    finally:
        worker.destroy(handle)  # idempotent: a 404 is success
        stack.close()
    cluster.settle()

    assert opened
    entries = logged(cluster, since, watches=len(opened))
    refused = [e for e in entries if e.code == 403]
    assert not refused, refused
    used = {grant_of(e) for e in entries}
    granted = rbac.grants(role)
    excessive = sorted(str(g) for g in granted - used)
    missing = sorted(str(g) for g in used - granted)
    assert (excessive, missing) == ([], []), f"granted, never used: {excessive}; used: {missing}"


# -- 2. a missing verb fails -----------------------------------------------------------------


@dataclass
class Case:
    """What the operations of one case act on and through."""

    settings: Settings
    cluster: RealCluster
    worker: KubernetesBackend
    shared: SandboxHandle
    base_image: str
    stack: contextlib.ExitStack
    made: list[SandboxHandle] = field(default_factory=list)

    def fresh(self) -> SandboxHandle:
        """A sandbox of its own, made under the whole Role (destroyed after the case)."""
        handle = self.worker.create(spec(self.base_image, "rbac-fresh"))
        self.made.append(handle)
        return handle

    def stranger(self) -> KubernetesBackend:
        """Another worker, which knows nothing of the sandbox but what the API says."""
        return as_worker(self.stack, self.settings, self.cluster, host_id="worker-b")


@dataclass(frozen=True)
class Need:
    """An operation that needs a grant: ``prepare`` runs under the whole Role and returns
    the call to make without the grant; ``action`` is how the backend names the refused
    request in its SandboxError (``None``: the backend does not surface the refusal)."""

    action: str | None
    prepare: Callable[[Case], Callable[[], object]]


def _create(name: str) -> Callable[[Case], Callable[[], object]]:
    return lambda case: lambda: case.worker.create(spec(case.base_image, name))


def _destroy_fresh(case: Case) -> Callable[[], object]:
    """destroy deletes the pod first, then the Secret: a sandbox the case may end."""
    handle = case.fresh()
    return lambda: case.worker.destroy(handle)


NEEDS: dict[Grant, Need] = {
    Grant("", "pods", "create"): Need("create sandbox pod", _create("rbac-no-pod-create")),
    Grant("", "pods", "watch"): Need("watch sandbox pod", _create("rbac-no-pod-watch")),
    Grant("", "secrets", "create"): Need("create sandbox secret", _create("rbac-no-secret")),
    Grant("", "pods", "get"): Need("read sandbox pod", lambda c: lambda: c.worker.probe(c.shared)),
    Grant("", "pods", "list"): Need("list sandbox pods", lambda c: c.worker.list_owned),
    # Refused, the pod stays: the shared sandbox lives on.
    Grant("", "pods", "delete"): Need(
        "delete sandbox pod", lambda c: lambda: c.worker.destroy(c.shared)
    ),
    Grant("", "secrets", "get"): Need(
        "read sandbox secret",
        lambda c: lambda: c.stranger().exec(c.shared, "true", timeout_s=5, output_budget_bytes=64),
    ),
    Grant("", "secrets", "list"): Need("list sandbox secrets", lambda c: c.worker.sweep_leftovers),
    Grant("", "secrets", "delete"): Need("delete sandbox secret", _destroy_fresh),
    # The events are only evidence of a failed create (backend.py `_events`: '' when they
    # cannot be read): the create fails for its own reason, without them.
    Grant("", "events", "list"): Need(
        None, lambda c: lambda: c.worker.create(spec(UNPULLABLE, "rbac-no-events"))
    ),
}


@contextlib.contextmanager
def role_without(
    cluster: RealCluster, objects: list[Obj], role: Obj, grant: Grant
) -> Iterator[tuple[int, float]]:
    """The worker's Role without ``grant`` on the server for the block, then the rendered
    one again. Yields how many rounds of access reviews the cut took to be in effect (1:
    by the first look after the update), and the seconds from the update until then."""
    everything = rbac.grants(role)
    cut = rbac.without(role, grant)
    started = time.monotonic()
    rbac.replace_role(cluster.api, cut)
    try:
        rounds = rbac.wait_authorized(cluster.api, objects, cut, everything=everything)
        yield rounds, time.monotonic() - started
    finally:
        rbac.replace_role(cluster.api, role)
        rbac.wait_authorized(cluster.api, objects, role, everything=everything)


def test_every_grant_has_an_operation_that_needs_it() -> None:
    assert sorted(NEEDS) == GRANTED


@pytest.mark.parametrize("grant", GRANTED, ids=str)
def test_a_role_without_a_verb_fails_the_operation_that_needs_it(
    grant: Grant,
    settings: Settings,
    cluster: RealCluster,
    objects: list[Obj],
    role: Obj,
    worker: KubernetesBackend,
    shared: SandboxHandle,
    base_image: str,
) -> None:
    need = NEEDS.get(grant)
    assert need is not None, f"the Role grants {grant}, and no operation here needs it"
    stack = contextlib.ExitStack()
    case = Case(settings, cluster, worker, shared, base_image, stack)
    pods_before, secrets_before = cluster.names("pods"), cluster.names("secrets")
    try:
        call = need.prepare(case)
        since = audit_mark(cluster)
        with role_without(cluster, objects, role, grant) as (rounds, took_s):
            # The RBAC authorizer reads Roles from an informer's cache: a change is in
            # effect one watch event after the update, with no cache of decisions to wait
            # out (measured here: by the first review after the update, in under 0.2 s).
            assert took_s < RBAC_AT_ONCE_S, f"the cut took {took_s:.2f} s ({rounds} rounds)"
            with pytest.raises(SandboxError) as failed:
                call()
        message = str(failed.value)
        if need.action is not None:
            assert f"kubernetes refused to {need.action}: 403 " in message, message
        else:
            assert "image_pull_failed" in message and "events:" not in message, message
        refused = {grant_of(e) for e in worker_requests(cluster, since) if e.code == 403}
        assert refused == {grant}
        assert worker.probe(shared).agent_ok  # the Role is whole again, the sandbox unharmed
    finally:
        for handle in case.made:
            worker.destroy(handle)
        stack.close()
    # A create refused half-way, or a destroy refused, left nothing behind.
    cluster.settle()
    assert cluster.names("pods") == pods_before
    assert cluster.names("secrets") == secrets_before
