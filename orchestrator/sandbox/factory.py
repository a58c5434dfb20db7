"""The one place that picks the sandbox backend from the settings."""

from __future__ import annotations

from orchestrator.config import Settings
from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.sandbox.k8s.backend import KubernetesBackend

HostBackend = DockerBackend | KubernetesBackend
"""A :class:`~orchestrator.sandbox.backend.SandboxBackend` that also reports its host's
health (``host_health``) and sweeps what crashes left behind (``sweep_leftovers``)."""


def make_backend(settings: Settings) -> HostBackend:
    """The backend ``settings.sandbox_backend`` names: containers on this host's dockerd,
    or pods on the Kubernetes cluster of the in-cluster configuration or KUBECONFIG."""
    if settings.sandbox_backend == "kubernetes":
        return KubernetesBackend(settings)
    return DockerBackend(settings)
