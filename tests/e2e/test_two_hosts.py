"""Two worker hosts, each with its own dockerd: every call of a rollout reaches the daemon
that holds its sandbox (docs/architecture.md: per-host queues).

A second dockerd (tests/daemons.py) runs beside the first with its own socket, data and exec
roots and its own bridge, as docs/architecture.md describes; its data root persists under the state
directory of the machine so the base image is loaded into it only once.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from orchestrator.config import Settings
from tests.daemons import DockerDaemon, running
from tests.stacks import Stack, deployment

pytestmark = [pytest.mark.xdist_group("two-hosts")]

SECOND = DockerDaemon(name="docker2", bridge="orchdocker1", address="10.231.0.1/24")
SOCKET = SECOND.socket


@pytest.fixture(scope="module")
def second_daemon(base_image: str) -> Iterator[docker.DockerClient]:
    with running(SECOND, base_image) as client:
        yield client


@pytest.fixture(scope="module")
def two_host_stack(settings: Settings, second_daemon: docker.DockerClient) -> Iterator[Stack]:
    # Short: sandbox sockets live under the state dirs, and Unix socket paths are short.
    tmp = Path(tempfile.mkdtemp(prefix="orch-2h-"))
    envs_file = tmp / "environments.yaml"
    # A fixed-image environment: both daemons hold the base image.
    envs_file.write_text(
        "environments:\n"
        "  - name: base-shell\n"
        f"    image: {settings.base_image}\n"
        "    tools: [shell, read_file]\n"
        "    grader: {name: file_f1}\n"
    )
    # One deployment, an API and two workers, each worker a host on its own daemon.
    stack = deployment(
        settings,
        "2h",
        logs=tmp,
        host_id="h1",
        state_dir=tmp / "h1",
        environments_file=envs_file,
        default_environment="base-shell",
    )
    hosts = {
        "h1": stack,
        "h2": deployment(
            settings,
            "2h",
            logs=tmp,
            host_id="h2",
            state_dir=tmp / "h2",
            docker_host=SOCKET,
            environments_file=envs_file,
            default_environment="base-shell",
        ),
    }
    try:
        for name, host in hosts.items():
            stack.start(f"worker-{name}", host.command("worker"), env=host.env)
        stack.start_role("api")
        stack.wait_ready()
        _wait_for_hosts(stack, 2)
        yield stack
    finally:
        stack.shut_down(*(host.settings for host in hosts.values()))


def _wait_for_hosts(stack: Stack, n: int) -> None:

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with stack.client() as client:
            checks = client.get("/v1/readiness", timeout=5).json()["checks"]
        if checks["workers"] >= n:
            return
        time.sleep(0.3)
    raise RuntimeError(f"fewer than {n} worker hosts came up")


def test_every_call_reaches_the_daemon_holding_the_sandbox(
    two_host_stack: Stack, second_daemon: docker.DockerClient
) -> None:
    first = docker.from_env()
    daemons = {"h1": first, "h2": second_daemon}
    seen_hosts: set[str] = set()
    try:
        with two_host_stack.client() as http:
            traces = [f"trace_{uuid.uuid4().hex}" for _ in range(6)]
            for trace in traces:
                for n in range(3):
                    response = http.post(
                        "/agent-rft/tools",
                        json={
                            "type": "function_call",
                            "id": f"fc_{n}",
                            "call_id": f"call_{n}",
                            "name": "shell",
                            "arguments": {"command": "hostname"},
                            "trace_id": trace,
                            "item": {},
                        },
                    )
                    assert response.status_code == 200, response.text
                    container_hostname = response.json()["output"].strip()
                    rollout = http.get(f"/v1/rollouts/{trace}").json()
                    host = rollout["host"]
                    seen_hosts.add(host)
                    # The container answering is the rollout's own, on its host's daemon,
                    # and on no other daemon.
                    owner = daemons[host].containers.list(
                        filters={"label": f"orchestrator.rollout={trace}"}
                    )
                    assert len(owner) == 1 and str(owner[0].id).startswith(container_hostname), (
                        host,
                        container_hostname,
                    )
                    for other, client in daemons.items():
                        if other != host:
                            assert not client.containers.list(
                                all=True, filters={"label": f"orchestrator.rollout={trace}"}
                            )
            assert seen_hosts == {"h1", "h2"}, (
                f"rollouts were not spread over both hosts: {seen_hosts}"
            )
            for trace in traces:
                assert http.delete(f"/v1/rollouts/{trace}").status_code == 200
        for client in daemons.values():
            assert not client.containers.list(
                all=True,
                filters={"label": f"orchestrator.deployment={two_host_stack.settings.deployment}"},
            )
    finally:
        first.close()
