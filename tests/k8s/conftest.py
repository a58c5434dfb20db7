"""A whole deployment on the Kubernetes backend: the real API, Celery worker and beat as
subprocesses with ``ORCH_SANDBOX_BACKEND=kubernetes``, talking to a real control plane
(cluster.py: kube-apiserver, controllers and scheduler on loopback, and the test kubelet in
this process) through a kubeconfig file as the chart's worker ServiceAccount, with
codebases from a catalogue file and no Docker daemon they can reach.

The stack reuses the end-to-end suite's ``Stack``; what differs is its environment and its
teardown (the sandboxes are pods, destroyed through the API server, not by a daemon).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
import yaml

from orchestrator.config import Settings
from orchestrator.environments.examples import REQUESTS_CODEBASE, ensure_requests_codebase
from orchestrator.local import free_port
from orchestrator.sandbox.gc import collect_expired
from orchestrator.sandbox.k8s.backend import KubernetesBackend
from tests import agent_caused
from tests.e2e.conftest import TOKEN, Stack, flush_redis, reaper_environments_yaml, stack_env
from tests.k8s.cluster import TestCluster

NAMESPACE = "orchestrator-sandboxes"
# Anything on the Kubernetes path that still asks a Docker daemon fails loudly here.
NO_DOCKER = "unix:///nonexistent/docker.sock"


class K8sStack(Stack):
    """The e2e ``Stack`` on pods: its cluster, and a backend of its deployment that looks
    at the pods from outside the stack's processes."""

    cluster: TestCluster
    k8s: KubernetesBackend
    image: str  # the codebase's image, as the catalogue names it

    def pods_of(self, rollout_id: str) -> list[str]:
        """Names of the live pods of ``rollout_id`` (read through the API server)."""
        return [h.native_id for h in self.k8s.list_owned() if h.rollout_id == rollout_id]


@pytest.fixture(scope="module")
def k8s_cluster(settings: Settings, client: docker.DockerClient) -> Iterator[TestCluster]:
    """A cluster of the module's own (control plane and test kubelet); it outlives the
    stack."""
    # Its containers carry a deployment of their own (still this run's, for the leak
    # check), so no Docker backend's label sweep takes them for its sandboxes.
    with TestCluster(client, docker_deployment=f"{settings.deployment}-kubelet-stack") as cluster:
        yield cluster


@pytest.fixture(scope="module")
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
    reaper_environments_yaml(path)
    data = yaml.safe_load(path.read_text())
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
    """API, worker and beat of a deployment of its own whose sandboxes are pods."""
    root = tmp_path_factory.mktemp("k8s-stack")
    kubeconfig = root / "kubeconfig"
    kubeconfig.write_text(json.dumps(k8s_cluster.kubeconfig(NAMESPACE)))  # JSON is YAML
    catalogue = root / "codebases.yaml"
    # The image as the local daemon names it: relative to an empty k8s_image_registry.
    catalogue.write_text(yaml.safe_dump({REQUESTS_CODEBASE: requests_image}))
    environments = _environments(root / "environments.yaml")
    stack_settings = settings.model_copy(
        update={
            "deployment": settings.deployment + "-k8s",
            "api_port": free_port(),
            "worker_metrics_port": free_port(),
            "host_id": f"k8s-{uuid.uuid4().hex[:6]}",
            "api_tokens": TOKEN,
            "log_format": "json",
            "sandbox_backend": "kubernetes",
            "k8s_namespace": NAMESPACE,
            "codebases_file": catalogue,
            "environments_file": environments,
            "docker_host": NO_DOCKER,
            "reaper_interval_s": 1.0,
        }
    )
    env = {
        **stack_env(stack_settings),
        "KUBECONFIG": str(kubeconfig),
        "ORCH_SANDBOX_BACKEND": "kubernetes",
        "ORCH_K8S_NAMESPACE": NAMESPACE,
        "ORCH_CODEBASES_FILE": str(catalogue),
        "ORCH_ENVIRONMENTS_FILE": str(environments),
        "ORCH_DOCKER_HOST": NO_DOCKER,
        "ORCH_REAPER_INTERVAL_S": "1",
    }
    env.pop("DOCKER_HOST", None)
    stack = K8sStack(
        settings=stack_settings,
        env=env,
        base_url=f"http://127.0.0.1:{stack_settings.api_port}",
        codebase=REQUESTS_CODEBASE,
        logs=root,
    )
    stack.cluster = k8s_cluster
    stack.image = requests_image
    stack.k8s = KubernetesBackend(stack_settings, client=k8s_cluster.client(NAMESPACE))
    from orchestrator.cli.serve import api_command, beat_command, worker_command

    try:
        stack.start("worker", worker_command(stack_settings))
        stack.start("beat", beat_command(stack_settings))
        stack.start("api", api_command(stack_settings))
        stack.wait_ready()
        yield stack
    finally:
        # Beat first: its reaper passes would wait for a worker that is gone.
        for name in sorted(stack.procs, key=lambda name: name != "beat"):
            stack.stop(name)
        collect_expired(stack.k8s, everything=True)
        k8s_cluster.settle()
        flush_redis(stack_settings)
