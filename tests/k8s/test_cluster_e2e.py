"""KubernetesBackend against a whole cluster, through KUBECONFIG as a worker outside the
cluster finds it: the cluster KUBECONFIG names when it is set (it needs the namespace,
ORCH_K8S_NAMESPACE, default orchestrator-sandboxes, the sandbox base image pullable under
ORCH_K8S_IMAGE_REGISTRY, and this machine able to reach pod IPs: run it from inside the
cluster, or on a kind/k3s node), else the test suite's own control plane and real node
(control_plane.py and node.py: a real API server, scheduler and controllers, and a real
kubelet on the local dockerd), as the chart's worker ServiceAccount."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from lightkube.resources.core_v1 import Pod, Secret

from orchestrator.config import Settings
from orchestrator.sandbox.backend import SandboxSpec
from orchestrator.sandbox.k8s import pods
from orchestrator.sandbox.k8s.backend import KubernetesBackend

# The real node's group (test_real_node.py says why).
pytestmark = pytest.mark.xdist_group("real-node")


@pytest.fixture(scope="module")
def kubeconfig(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """KUBECONFIG's cluster, else the suite's own (its worker's kubeconfig): asked for only
    then, so a KUBECONFIG run starts no control plane."""
    named = os.environ.get("KUBECONFIG")
    if named:
        yield named
        return
    cluster = request.getfixturevalue("real_cluster")  # tests/k8s/conftest.py
    path = tmp_path_factory.mktemp("k8s-e2e") / "kubeconfig"
    path.write_text(json.dumps(cluster.kubeconfig()))  # JSON is YAML
    yield str(path)


@pytest.fixture(scope="module")
def cluster_backend(
    kubeconfig: str, base_image: str, monkeypatch_module: pytest.MonkeyPatch
) -> Iterator[KubernetesBackend]:
    monkeypatch_module.setenv("KUBECONFIG", kubeconfig)
    settings = Settings(sandbox_backend="kubernetes", deployment=f"k8s-e2e-{uuid.uuid4().hex[:6]}")
    backend = KubernetesBackend(settings)
    yield backend
    for handle in backend.list_owned():
        backend.destroy(handle)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_sandbox_pod_lifecycle(cluster_backend: KubernetesBackend) -> None:
    settings = cluster_backend.settings
    spec = SandboxSpec.from_settings(settings, image=settings.base_image, rollout_id="e2e")
    handle = cluster_backend.create(spec)
    try:
        result = cluster_backend.exec(
            handle, "id -u; echo hi > note.txt", timeout_s=30, output_budget_bytes=4096
        )
        assert result.exit_code == 0 and result.stdout.head == "1000\n"
        found = cluster_backend.read_file(handle, "note.txt", max_bytes=1024)
        assert found.text == "hi\n"
        probe = cluster_backend.probe(handle)
        assert probe.alive and probe.agent_ok and probe.state == "running"
        assert [h.sandbox_id for h in cluster_backend.list_owned()] == [handle.sandbox_id]
        assert cluster_backend.host_health().backend_ok
    finally:
        cluster_backend.destroy(handle)
    cluster_backend.destroy(handle)  # idempotent
    assert cluster_backend.list_owned() == []
    gone = cluster_backend.probe(handle)
    assert not gone.alive and gone.state in ("missing", "terminating")
    client = cluster_backend.client
    selector: dict[str, Any] = dict(pods.selector(settings))
    leftover_pods = [
        p
        for p in client.list(Pod, namespace=settings.k8s_namespace, labels=selector)
        if p.metadata is not None and p.metadata.deletionTimestamp is None
    ]
    assert leftover_pods == []
    secrets = list(client.list(Secret, namespace=settings.k8s_namespace, labels=selector))
    assert secrets == []
