"""One way to reach the Docker daemon, shared by the sandbox backend and the image builder."""

from __future__ import annotations

import docker
from docker.errors import DockerException

from orchestrator.config import Settings
from orchestrator.sandbox.backend import BackendUnavailable


def connect(settings: Settings, *, timeout_s: float = 60.0) -> docker.DockerClient:
    """A client for the configured daemon; :class:`BackendUnavailable` when it is down.

    Its connection pool is as large as the worker's thread pool: with the default 10, a
    burst of creations made threads open and drop connections ("Connection pool is
    full")."""
    pool = max(10, settings.worker_concurrency)
    try:
        if settings.docker_host:
            client = docker.DockerClient(
                base_url=settings.docker_host, timeout=int(timeout_s), max_pool_size=pool
            )
        else:
            client = docker.from_env(timeout=int(timeout_s), max_pool_size=pool)
        client.ping()
    except DockerException as exc:
        raise BackendUnavailable(f"docker daemon unreachable: {exc}") from exc
    return client
