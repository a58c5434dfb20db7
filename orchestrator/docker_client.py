"""One way to reach the Docker daemon, shared by the sandbox backend and the image builder."""

from __future__ import annotations

import docker
from docker.errors import DockerException

from orchestrator.config import Settings
from orchestrator.sandbox.backend import BackendUnavailable


def connect(settings: Settings, *, timeout_s: float = 60.0) -> docker.DockerClient:
    """A client for the configured daemon; :class:`BackendUnavailable` when it is down."""
    try:
        if settings.docker_host:
            client = docker.DockerClient(base_url=settings.docker_host, timeout=int(timeout_s))
        else:
            client = docker.from_env(timeout=int(timeout_s))
        client.ping()
    except DockerException as exc:
        raise BackendUnavailable(f"docker daemon unreachable: {exc}") from exc
    return client
