"""The kernel's log as OOM evidence (orchestrator/sandbox/docker/kernel_log.py), read from the real
/dev/kmsg: a record written there (as root) is read back like the kernel's own."""

from __future__ import annotations

import os
import uuid

import docker
import pytest

from orchestrator.config import Runtime
from orchestrator.sandbox.docker import kernel_log
from tests.conftest import RUNTIMES, runsc_available


def _container_id() -> str:
    return (uuid.uuid4().hex + uuid.uuid4().hex)[:64]


@pytest.fixture()
def kmsg_writable() -> None:
    if not os.access(kernel_log.KMSG, os.R_OK | os.W_OK):
        pytest.skip("/dev/kmsg is not readable and writable here (needs root)")


def _log(line: str) -> None:
    with open(kernel_log.KMSG, "w") as kmsg:
        kmsg.write(line + "\n")


def test_an_oom_kill_in_the_containers_cgroup_is_found(kmsg_writable: None) -> None:
    victim, bystander = _container_id(), _container_id()
    # The kernel's summary line, as mm/oom_kill.c prints it for a memcg OOM kill.
    _log(
        "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),"
        f"cpuset={victim},mems_allowed=0,oom_memcg=/docker/{victim},"
        f"task_memcg=/docker/{victim},task=exe,pid=1,uid=65534"
    )
    # Another line naming the bystander, but no OOM kill of it.
    _log(f"test: container {bystander} exited")
    assert kernel_log.memcg_oom_killed(victim) is True
    assert kernel_log.memcg_oom_killed(bystander) is False


def test_no_evidence_is_none_not_an_error() -> None:
    assert kernel_log.memcg_oom_killed(_container_id(), path="/nonexistent/kmsg") is None
    assert kernel_log.memcg_oom_killed("abc") is None  # too short to name one container


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_kernel_names_the_container_it_oom_killed(
    kmsg_writable: None, base_image: str, runtime: Runtime
) -> None:
    """What the probe relies on: a container killed at its memory limit (under gVisor, its
    sentry) is named by the kernel's OOM line; Docker's own flag is not consulted here."""
    if runtime == "runsc" and not runsc_available():
        pytest.skip("gVisor (runsc) is not registered with this Docker daemon")
    client = docker.from_env()
    container = client.containers.run(
        base_image,
        ["python3", "-c", "x = bytearray(400 << 20)"],
        runtime=runtime,
        mem_limit="128m",
        memswap_limit="128m",
        network_disabled=True,
        detach=True,
    )
    try:
        assert container.wait(timeout=60)["StatusCode"] == 137
        assert kernel_log.memcg_oom_killed(str(container.id)) is True
    finally:
        container.remove(force=True)
        client.close()
