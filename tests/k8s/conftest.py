"""The Kubernetes tests' cluster, and a whole deployment on the Kubernetes backend.

``real_cluster``: the real control plane (control_plane.py) and a real node (node.py: the
kubelet built from Debian's source, dockershim on the local dockerd, CNI pod addresses),
read and acted on through cluster.py's ``RealCluster``, for the modules of group
``real-node`` (one real kubelet per Docker daemon: they run one after another on one xdist
worker).

``k8s_stack``: the real API, Celery worker and reaper as subprocesses with
``ORCH_SANDBOX_BACKEND=kubernetes``, on the real node, talking to the API server through
a kubeconfig file as the chart's worker ServiceAccount, with codebases from a catalogue
file and no Docker daemon they can reach.

The stack reuses the end-to-end suite's ``Stack``; what differs is its environment and its
teardown (the sandboxes are pods, destroyed through the API server, not by a daemon).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.config import Settings
from orchestrator.environments.examples import REQUESTS_CODEBASE, ensure_requests_codebase
from orchestrator.environments.loader import default_environments_text
from orchestrator.sandbox.gc import collect_expired
from orchestrator.sandbox.k8s.backend import KubernetesBackend
from tests import agent_caused
from tests.k8s.cluster import Api, RealCluster
from tests.k8s.control_plane import ControlPlane
from tests.k8s.node import RealNode
from tests.k8s.rbac import RELEASE_NAMESPACE, SANDBOX_NAMESPACE, apply_worker_rbac
from tests.stacks import ROLES, Stack, deployment, flush_redis

NAMESPACE = "orchestrator-sandboxes"
# Anything on the Kubernetes path that still asks a Docker daemon fails loudly here.
NO_DOCKER = "unix:///nonexistent/docker.sock"

Obj = dict[str, Any]


@pytest.fixture(scope="module")
def real_node_options() -> dict[str, Any]:
    """Keyword arguments of the module's ``RealNode`` (a module overrides this fixture)."""
    return {}


@pytest.fixture(scope="module")
def real_cluster(real_node_options: dict[str, Any]) -> Iterator[RealCluster]:
    """A control plane and its real node (node.py), with the chart's worker RBAC applied:
    for the modules of group ``real-node`` (one real kubelet per daemon at a time)."""
    with (
        ControlPlane(namespaces=(RELEASE_NAMESPACE, SANDBOX_NAMESPACE)) as plane,
        contextlib.closing(Api(plane, "admin")) as api,
    ):
        worker_user, token = apply_worker_rbac(api)
        with (
            RealNode(plane, **real_node_options) as node,
            contextlib.closing(plane.client("worker", SANDBOX_NAMESPACE, token=token)) as worker,
        ):
            cluster = RealCluster(
                plane=plane,
                node=node,
                api=api,
                worker=worker,
                worker_user=worker_user,
                token=token,
            )
            cluster.settle()
            yield cluster
            cluster.settle()


class K8sStack(Stack):
    """The e2e ``Stack`` on pods: its cluster, and a backend of its deployment that looks
    at the pods from outside the stack's processes."""

    cluster: RealCluster
    k8s: KubernetesBackend
    image: str  # the codebase's image, as the catalogue names it

    def pods_of(self, rollout_id: str) -> list[str]:
        """Names of the live pods of ``rollout_id`` (read through the API server)."""
        return [h.native_id for h in self.k8s.list_owned() if h.rollout_id == rollout_id]


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


def k8s_deployment(
    settings: Settings, cluster: RealCluster, image: str, root: Path, name: str = "k8s"
) -> K8sStack:
    """A deployment of its own (not started) whose sandboxes are pods of ``cluster``, its
    configuration and logs under ``root``."""
    kubeconfig = root / "kubeconfig"
    kubeconfig.write_text(json.dumps(cluster.kubeconfig(NAMESPACE)))  # JSON is YAML
    catalogue = root / "codebases.yaml"
    # The image as the local daemon names it: relative to an empty k8s_image_registry.
    catalogue.write_text(yaml.safe_dump({REQUESTS_CODEBASE: image}))
    environments = _environments(root / "environments.yaml")
    made = deployment(
        settings,
        name,
        logs=root,
        codebase=REQUESTS_CODEBASE,
        env={"KUBECONFIG": str(kubeconfig)},
        sandbox_backend="kubernetes",
        k8s_namespace=NAMESPACE,
        codebases_file=catalogue,
        environments_file=environments,
        docker_host=NO_DOCKER,
        reaper_interval_s=1.0,
        # A real kubelet's pod start: its once-a-second status polling, the probe's delay.
        sandbox_start_timeout_s=60,
    )
    made.env.pop("DOCKER_HOST", None)
    stack = K8sStack(settings=made.settings, env=made.env, codebase=made.codebase, logs=root)
    stack.cluster = cluster
    stack.image = image
    stack.k8s = KubernetesBackend(stack.settings, client=cluster.client(NAMESPACE))
    return stack


def stop_k8s_deployment(stack: K8sStack) -> None:
    """Its processes stopped, its pods destroyed through the API server (not by a daemon)
    and settled on the node, its Redis keys forgotten."""
    try:
        stack.stop_all()
        collect_expired(stack.k8s, everything=True)
        stack.cluster.settle()
        flush_redis(stack.settings)
    finally:
        stack.k8s.client.close()


@pytest.fixture(scope="module")
def k8s_stack(
    settings: Settings,
    real_cluster: RealCluster,
    requests_image: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[K8sStack]:
    """API, worker and reaper of a deployment of its own whose sandboxes are pods."""
    stack = k8s_deployment(
        settings, real_cluster, requests_image, tmp_path_factory.mktemp("k8s-stack")
    )
    try:
        for role in ROLES:
            stack.start_role(role)
        stack.wait_ready()
        yield stack
    finally:
        stop_k8s_deployment(stack)
