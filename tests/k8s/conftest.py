"""A whole deployment on the Kubernetes backend: the real API, Celery worker and reaper as
subprocesses with ``ORCH_SANDBOX_BACKEND=kubernetes``, talking to a real control plane
(cluster.py: kube-apiserver, controllers and scheduler on loopback, and the test kubelet in
this process) through a kubeconfig file as the chart's worker ServiceAccount, with
codebases from a catalogue file and no Docker daemon they can reach.

The stack reuses the end-to-end suite's ``Stack``; what differs is its environment and its
teardown (the sandboxes are pods, destroyed through the API server, not by a daemon).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import docker
import pytest
import yaml
from lightkube import Client

from orchestrator.config import Settings
from orchestrator.environments.examples import REQUESTS_CODEBASE, ensure_requests_codebase
from orchestrator.environments.loader import default_environments_text
from orchestrator.sandbox.gc import collect_expired
from orchestrator.sandbox.k8s.backend import KubernetesBackend
from tests import agent_caused
from tests.k8s.cluster import Api, TestCluster
from tests.k8s.control_plane import ControlPlane
from tests.k8s.node import RealNode
from tests.k8s.rbac import RELEASE_NAMESPACE, SANDBOX_NAMESPACE, apply_worker_rbac
from tests.stacks import ROLES, Stack, deployment, flush_redis

NAMESPACE = "orchestrator-sandboxes"
# Anything on the Kubernetes path that still asks a Docker daemon fails loudly here.
NO_DOCKER = "unix:///nonexistent/docker.sock"


class RealCluster(NamedTuple):
    """A control plane, its real node, and clients as the admin and as the chart's worker
    (``token``: its ServiceAccount's)."""

    plane: ControlPlane
    node: RealNode
    admin: Client
    worker: Client
    token: str

    def worker_kubeconfig(self) -> dict[str, Any]:
        """A kubeconfig as the chart's worker ServiceAccount, in the sandbox namespace."""
        return self.plane.kubeconfig_for("worker", SANDBOX_NAMESPACE, token=self.token)


@pytest.fixture(scope="module")
def real_cluster() -> Iterator[RealCluster]:
    """A control plane and its real node (node.py), with the chart's worker RBAC applied:
    for the modules of group ``real-node`` (one real kubelet per daemon at a time)."""
    with ControlPlane(namespaces=(RELEASE_NAMESPACE, SANDBOX_NAMESPACE)) as plane:
        admin_api = Api(plane, "admin")
        try:
            _, token = apply_worker_rbac(admin_api)
        finally:
            admin_api.close()
        with (
            RealNode(plane) as node,
            contextlib.closing(plane.client()) as admin,
            contextlib.closing(plane.client("worker", SANDBOX_NAMESPACE, token=token)) as worker,
        ):
            yield RealCluster(plane=plane, node=node, admin=admin, worker=worker, token=token)


class K8sStack(Stack):
    """The e2e ``Stack`` on pods: its cluster, and a backend of its deployment that looks
    at the pods from outside the stack's processes."""

    cluster: TestCluster
    k8s: KubernetesBackend
    image: str  # the codebase's image, as the catalogue names it

    def pods_of(self, rollout_id: str) -> list[str]:
        """Names of the live pods of ``rollout_id`` (read through the API server)."""
        return [h.native_id for h in self.k8s.list_owned() if h.rollout_id == rollout_id]


@pytest.fixture(scope="session")
def k8s_session_cluster(settings: Settings, client: docker.DockerClient) -> Iterator[TestCluster]:
    """The session's one cluster (control plane and test kubelet), shared by every module
    here: they all run on one xdist worker (group ``k8s``), one after another. Starting
    one cost about 10 s of both cores; five modules each started their own."""
    # Its containers carry a deployment of their own (still this run's, for the leak
    # check), so no Docker backend's label sweep takes them for its sandboxes.
    with TestCluster(client, docker_deployment=f"{settings.deployment}-kubelet") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def k8s_cluster(k8s_session_cluster: TestCluster) -> Iterator[TestCluster]:
    """The session's cluster for one module: settled (no pod of the module before it left
    going) when the module starts and when it ends."""
    k8s_session_cluster.settle()
    yield k8s_session_cluster
    k8s_session_cluster.settle()


@pytest.fixture(scope="session")
def requests_image(settings: Settings, base_image: str) -> str:
    """The `requests` codebase as a local image: the test kubelet runs local images."""
    return ensure_requests_codebase(settings)


POOLED = "pooled-planning"
"""An environment with one warm pod of the `requests` codebase."""
ACTS = "agent-acts"
"""The agent-caused table's environment (tests/agent_caused.py's limits)."""
OUTAGE = "outage-planning"
"""Planning on the `requests` codebase for a trainer that calls on through an API server
outage: not reaped as idle for longer than a restart takes (the trainer's calls are not
what keeps it alive), no call budget, and the reaper's short grace after grading."""


def _environments(path: Path) -> Path:
    """The default environments with an idle timeout and a grace after grading of a few
    seconds (the reaper ends rollouts within a test's patience), plus ``POOLED``, ``ACTS``
    and ``OUTAGE``."""
    data = yaml.safe_load(default_environments_text())
    for environment in data["environments"]:
        if environment["name"] == "codebase-planning":
            environment.update(idle_timeout_s=4, grace_after_grade_s=2)
    data["environments"].append(
        {
            "name": POOLED,
            "codebase": REQUESTS_CODEBASE,
            "pool_size": 1,
            "tools": ["shell", "read_file"],
            "grader": {"name": "file_f1"},
            "idle_timeout_s": 30,
        }
    )
    data["environments"].append(
        {
            "name": ACTS,
            "codebase": REQUESTS_CODEBASE,
            "tools": ["shell"],
            "limits": agent_caused.LIMITS,
            "grader": {"name": "file_f1"},
        }
    )
    data["environments"].append(
        {
            "name": OUTAGE,
            "codebase": REQUESTS_CODEBASE,
            "tools": ["shell", "read_file"],
            "grader": {"name": "file_f1"},
            "idle_timeout_s": 120,
            "grace_after_grade_s": 2,
        }
    )
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def k8s_stack(
    settings: Settings,
    k8s_cluster: TestCluster,
    requests_image: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[K8sStack]:
    """API, worker and reaper of a deployment of its own whose sandboxes are pods."""
    root = tmp_path_factory.mktemp("k8s-stack")
    kubeconfig = root / "kubeconfig"
    kubeconfig.write_text(json.dumps(k8s_cluster.kubeconfig(NAMESPACE)))  # JSON is YAML
    catalogue = root / "codebases.yaml"
    # The image as the local daemon names it: relative to an empty k8s_image_registry.
    catalogue.write_text(yaml.safe_dump({REQUESTS_CODEBASE: requests_image}))
    environments = _environments(root / "environments.yaml")
    made = deployment(
        settings,
        "k8s",
        logs=root,
        codebase=REQUESTS_CODEBASE,
        env={"KUBECONFIG": str(kubeconfig)},
        sandbox_backend="kubernetes",
        k8s_namespace=NAMESPACE,
        codebases_file=catalogue,
        environments_file=environments,
        docker_host=NO_DOCKER,
        reaper_interval_s=1.0,
    )
    made.env.pop("DOCKER_HOST", None)
    stack = K8sStack(settings=made.settings, env=made.env, codebase=made.codebase, logs=root)
    stack.cluster = k8s_cluster
    stack.image = requests_image
    stack.k8s = KubernetesBackend(stack.settings, client=k8s_cluster.client(NAMESPACE))
    try:
        for role in ROLES:
            stack.start_role(role)
        stack.wait_ready()
        yield stack
    finally:
        stack.stop_all()
        # The sandboxes are pods: destroyed through the API server, not by a daemon.
        collect_expired(stack.k8s, everything=True)
        k8s_cluster.settle()
        flush_redis(stack.settings)
