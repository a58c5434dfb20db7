"""``KubernetesBackend`` on a real node: the control plane of control_plane.py and a real
kubelet (node.py: dockershim on the local dockerd, pod addresses from Debian's CNI plugins).
A sandbox is created as the chart's worker, runs a command through its agent at the pod IP,
and is destroyed: its pod and Secret gone from the API server, no container of it running.
The kubelet removes a deleted pod's exited containers (its pause container) only in its
garbage collection, once a minute; the node's ``settle`` does that at once, after which
nothing of the pod is left on the Docker daemon."""

from __future__ import annotations

import ipaddress
import time

import pytest

from orchestrator.config import Settings
from orchestrator.environments.examples import ensure_requests_codebase
from orchestrator.sandbox.backend import SandboxHandle
from orchestrator.sandbox.k8s.backend import KubernetesBackend
from orchestrator.sandbox.k8s.pods import CONTAINER, SEED_CONTAINER
from tests.k8s.cluster import RealCluster
from tests.k8s.node import CONTAINER_NAME_LABEL, POD_LOGS, POD_UID_LABEL
from tests.k8s.test_backend import k8s_settings, spec

# The group of the real node's modules (this, test_backend, test_rbac, test_cluster_e2e,
# test_helm_install, test_stack_on_kubernetes, test_agent_caused), one after another on one
# worker: one real kubelet per Docker daemon is node.py's lock, and a module of this group
# never holds a worker waiting for it. The real kubelet leaves the other tests' containers
# alone (they carry no io.kubernetes.* label), and kube-proxy's rules match only its own
# Services' addresses.
pytestmark = pytest.mark.xdist_group("real-node")

# Measured: the pod gone from the API server 0.02 s after the destroy, its containers
# stopped 0.3 s after.
DESTROYED_TIMEOUT_S = 15.0


@pytest.fixture(scope="module")
def codebase_image(settings: Settings, base_image: str) -> str:
    """The `requests` codebase: the init container copies its /workspace into the pod."""
    return ensure_requests_codebase(settings)


def test_a_sandbox_runs_on_a_real_kubelet_and_leaves_nothing(
    real_cluster: RealCluster, settings: Settings, codebase_image: str
) -> None:
    node = real_cluster.node
    k8s = KubernetesBackend(k8s_settings(settings), client=real_cluster.worker)
    handle: SandboxHandle | None = k8s.create(spec(codebase_image, "real-node"))
    assert handle is not None
    name = handle.native_id
    try:
        pod = real_cluster.read("pods", name)
        assert pod is not None
        uid = pod["metadata"]["uid"]
        assert pod["status"]["phase"] == "Running"
        # The pod's own address on the node's pod network, reached over its veth.
        assert node.subnet is not None
        assert ipaddress.ip_address(pod["status"]["podIP"]) in node.subnet
        # Made by this kubelet through dockershim (its labels, under its cgroup root): the
        # pause container and the sandbox running, the seeding init container done.
        made = {
            c.labels[CONTAINER_NAME_LABEL]: (c.status, c.attrs["State"]["ExitCode"])
            for c in node.containers()
            if c.labels.get(POD_UID_LABEL) == uid
        }
        assert made == {
            "POD": ("running", 0),
            SEED_CONTAINER: ("exited", 0),
            CONTAINER: ("running", 0),
        }

        result = k8s.exec(
            handle,
            "id -u; pwd; git log --oneline | wc -l; touch /etc/x 2>&1",
            timeout_s=30,
            output_budget_bytes=4096,
        )
        lines = result.stdout.head.splitlines()
        assert lines[:2] == ["1000", "/workspace"]
        assert int(lines[2]) >= 1  # the init container copied the codebase, .git included
        assert "Read-only file system" in lines[3]
        assert result.exit_code != 0
    finally:
        k8s.destroy(handle)
    # Destroyed, as the product means it: the pod and its Secret gone from the API server
    # and no container of the pod running.
    deadline = time.monotonic() + DESTROYED_TIMEOUT_S
    while real_cluster.read("pods", name) or node.pod_containers(uid, running=True):
        assert time.monotonic() < deadline, (
            f"not destroyed after {DESTROYED_TIMEOUT_S} s: pod {real_cluster.read('pods', name)}, "
            f"running {node.pod_containers(uid, running=True)}"
        )
        time.sleep(0.1)
    assert real_cluster.read("secrets", name) is None
    assert k8s.list_owned() == []
    # What is left of it is exited (its pause container), for the kubelet's garbage
    # collection to remove within a minute; the node removes it now.
    node.wait_settled(DESTROYED_TIMEOUT_S)
    assert node.pod_containers(uid) == []
    assert list(POD_LOGS.glob(f"*_{uid}")) == []
