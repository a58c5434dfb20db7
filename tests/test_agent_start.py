"""The exec agent starts from bytecode compiled on the host (sandbox/agent/__init__.py):
in the real base image, on runc and gVisor, with the mounts a Docker sandbox has, Python
reads the agent's code from the mounted __pycache__ instead of compiling the source, and
without that cache (an image whose Python is another version finds none of its tag) the
agent still starts, from its source."""

from __future__ import annotations

from pathlib import Path

import docker

from orchestrator.config import Runtime, Settings
from orchestrator.sandbox.agent import AGENT_LOADER, AGENT_MODULES, compiled_agent
from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.sandbox.docker.containers import (
    AGENT_CACHE_IN_SANDBOX,
    AGENT_DIR_IN_SANDBOX,
    AGENT_IN_SANDBOX,
)


def from_cache(module: str) -> str:
    return f"code object from '{AGENT_CACHE_IN_SANDBOX}/{module}."


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
            **{
                str(path): {"bind": f"{AGENT_DIR_IN_SANDBOX}/{name}.py", "mode": "ro"}
                for name, path in AGENT_MODULES.items()
            },
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
    cache = compiled_agent(AGENT_MODULES, settings.state_dir / "agent")
    assert cache == compiled_agent(AGENT_MODULES, settings.state_dir / "agent"), "made once"
    out, err = _start(client, backend, base_image, runtime, cache)
    assert "usage: exec_agent.py" in out
    # Every module of the agent, each from the host's bytecode: none compiled at a start.
    for module in AGENT_MODULES:
        assert from_cache(module) in err, [line for line in err.splitlines() if module in line]


def test_without_bytecode_of_its_version_the_agent_compiles_its_source(
    client: docker.DockerClient,
    backend: DockerBackend,
    base_image: str,
    tmp_path: Path,
) -> None:
    out, err = _start(client, backend, base_image, "runc", tmp_path)
    assert "usage: exec_agent.py" in out
    assert not any(from_cache(module) in err for module in AGENT_MODULES)


def test_the_threads_of_a_first_burst_compile_the_agent_without_tripping_on_each_other(
    tmp_path: Path,
) -> None:
    """A worker's creation threads reach a fresh state_dir's agent cache at once: each
    writes its own partial file (one name per process let one thread rename another's away:
    FileNotFoundError, a sandbox of a first burst not made). Sixteen threads, five rounds:
    before the fix the first round failed."""
    import threading

    for round_ in range(5):
        root = tmp_path / f"round-{round_}"
        start = threading.Barrier(16)
        errors: list[BaseException] = []
        found: list[Path] = []

        def compile_once(
            root: Path = root,
            start: threading.Barrier = start,
            found: list[Path] = found,
            errors: list[BaseException] = errors,
        ) -> None:
            start.wait()
            try:
                found.append(compiled_agent(AGENT_MODULES, root))
            except BaseException as exc:  # noqa: BLE001 (the test reports it)
                errors.append(exc)

        threads = [threading.Thread(target=compile_once) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert len(set(found)) == 1
        tag = __import__("sys").implementation.cache_tag
        assert sorted(p.name for p in found[0].iterdir()) == sorted(
            f"{module}.{tag}.pyc" for module in AGENT_MODULES
        )
