"""The exec agent starts from bytecode compiled on the host (sandbox/agent/__init__.py):
in the real base image, on runc and gVisor, with the mounts a Docker sandbox has, Python
reads the agent's code from the mounted __pycache__ instead of compiling the source, and
without that cache (an image whose Python is another version finds none of its tag) the
agent still starts, from its source."""

from __future__ import annotations

from pathlib import Path

import docker

from orchestrator.config import Runtime, Settings
from orchestrator.sandbox.agent import AGENT_LOADER, EXEC_AGENT_PATH, compiled_agent
from orchestrator.sandbox.docker import AGENT_CACHE_IN_SANDBOX, AGENT_IN_SANDBOX, DockerBackend

FROM_CACHE = f"code object from '{AGENT_CACHE_IN_SANDBOX}/exec_agent."


def _start(
    client: docker.DockerClient,
    backend: DockerBackend,
    image: str,
    runtime: Runtime,
    cache: Path,
) -> tuple[str, str]:
    """The agent's start as a sandbox makes it (`--help`, so it exits): (stdout, the
    interpreter's verbose import log)."""
    container = client.containers.run(
        image,
        ["python3", "-I", "-S", "-v", "-c", AGENT_LOADER, AGENT_IN_SANDBOX, "--help"],
        runtime=backend.oci_runtime(runtime),
        read_only=True,
        network_mode="none",
        volumes={
            str(EXEC_AGENT_PATH): {"bind": AGENT_IN_SANDBOX, "mode": "ro"},
            str(cache): {"bind": AGENT_CACHE_IN_SANDBOX, "mode": "ro"},
        },
        detach=True,
    )
    try:
        assert container.wait(timeout=60)["StatusCode"] == 0
        out = container.logs(stdout=True, stderr=False).decode()
        err = container.logs(stdout=False, stderr=True).decode()
    finally:
        container.remove(force=True)
    return out, err


def test_the_agent_starts_from_the_hosts_bytecode(
    client: docker.DockerClient,
    backend: DockerBackend,
    base_image: str,
    runtime: Runtime,
    settings: Settings,
) -> None:
    cache = compiled_agent(EXEC_AGENT_PATH, settings.state_dir / "agent")
    assert cache == compiled_agent(EXEC_AGENT_PATH, settings.state_dir / "agent"), "made once"
    out, err = _start(client, backend, base_image, runtime, cache)
    assert "usage: exec_agent.py" in out
    assert FROM_CACHE in err, [line for line in err.splitlines() if "exec_agent" in line]


def test_without_bytecode_of_its_version_the_agent_compiles_its_source(
    client: docker.DockerClient,
    backend: DockerBackend,
    base_image: str,
    tmp_path: Path,
) -> None:
    out, err = _start(client, backend, base_image, "runc", tmp_path)
    assert "usage: exec_agent.py" in out
    assert FROM_CACHE not in err
