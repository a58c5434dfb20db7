"""The real exec agent in its Kubernetes mode (TCP, per-sandbox token), in a real container of
the sandbox base image run as a pod runs it (pods.py): the agent as root with only SETUID,
SETGID, SETPCAP and KILL, commands as uid 1000, read-only root, no new privileges, the
Secret's files readable by root alone. Reached by the TCP client as a worker
reaches a pod's IP, but on loopback: the container shares the host's network and the agent
listens on an address of its own in 127.0.0.0/8 (tests send no traffic to bridge
addresses). So the container is not network-isolated here, and no test relies on it."""

from __future__ import annotations

import json
import os
import secrets
import socket
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import docker
import pytest
from docker.models.containers import Container
from docker.types import Mount

from orchestrator.config import Settings
from orchestrator.sandbox import labels
from orchestrator.sandbox.agent import AGENT_MODULES
from orchestrator.sandbox.agent import agent_protocol as protocol
from orchestrator.sandbox.agent import client as agent
from orchestrator.sandbox.agent.client import AgentUnauthorized
from orchestrator.sandbox.backend import FileError, SandboxSpec, SandboxUnavailable
from orchestrator.sandbox.k8s import pods
from tests.k8s import loopback

AGENT_DIR = "/opt/orchestrator/agent"
NOW = datetime(2026, 12, 1, tzinfo=UTC)


class Agent:
    """Where the agent in the container listens, and its token."""

    def __init__(self, container: Container, ip: str, port: int, token: str) -> None:
        self.container = container
        self.ip = ip
        self.port = port
        self.token = token

    def call(self, request: dict[str, object], token: str | None = None) -> dict[str, object]:
        token = self.token if token is None else token
        return agent.call_tcp(self.ip, self.port, token, request, 30)


@pytest.fixture(scope="module")
def tcp_agent(settings: Settings, base_image: str, client: docker.DockerClient) -> Iterator[Agent]:
    token = secrets.token_urlsafe(32)
    with (
        loopback.held() as (ip, port),
        tempfile.TemporaryDirectory(prefix="orch-k8s-agent-") as scratch,
    ):
        # As the pod's Secret volume: the agent's code and its token, read-only, root's
        # alone (defaultMode 0400, no fsGroup).
        secret_dir = Path(scratch)
        for name, path in AGENT_MODULES.items():
            (secret_dir / f"{name}.py").write_bytes(path.read_bytes())
        (secret_dir / pods.TOKEN_KEY).write_text(token)
        for entry in (secret_dir, *secret_dir.iterdir()):
            os.chown(entry, 0, 0)
            entry.chmod(0o755 if entry.is_dir() else 0o400)
        rendered = pods.render_pod(
            settings.model_copy(update={"k8s_agent_port": port}),
            SandboxSpec(image=base_image),
            pods.SandboxIdentity(
                sandbox_id="sbx-tcpagent", host="h", created_at=NOW, expires_at=NOW
            ),
            disk_mb=64,
            output_mb=64,
        )
        main = rendered.spec.containers[0] if rendered.spec else None
        assert main is not None and main.command and main.securityContext
        command = [c.replace("0.0.0.0", ip) for c in main.command]
        capabilities = main.securityContext.capabilities
        container = client.containers.run(
            base_image,
            command=command,
            detach=True,
            network_mode="host",
            name=f"orch-{settings.deployment}-k8s-agent-{secrets.token_hex(3)}",
            labels={labels.MANAGED: "true", labels.DEPLOYMENT: settings.deployment},
            user=f"{main.securityContext.runAsUser}:{main.securityContext.runAsGroup}",
            read_only=True,
            cap_drop=capabilities.drop if capabilities else None,
            cap_add=capabilities.add if capabilities else None,
            security_opt=["no-new-privileges"],
            init=True,  # the pod's shared process namespace: its pause process reaps
            mem_limit="512m",
            pids_limit=256,
            tmpfs={
                "/tmp": "rw,nosuid,nodev,size=64m,mode=1777",
                "/home/agent": "rw,nosuid,nodev,size=16m,uid=1000,gid=1000",
                "/workspace": "rw,nosuid,nodev,size=64m,uid=1000,gid=1000",
            },
            mounts=[Mount(AGENT_DIR, str(secret_dir), type="bind", read_only=True)],
        )
        try:
            ready = Agent(container, ip, port, token)
            deadline = time.monotonic() + 20
            while True:
                try:
                    ready.call(protocol.ping())
                    break
                except SandboxUnavailable:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            yield ready
        finally:
            container.remove(force=True, v=True)


def test_right_token_runs_a_command_as_uid_1000(tcp_agent: Agent) -> None:
    request = protocol.exec_request("id -u; id -G; touch /etc/x 2>&1; echo done", 10, 4096, "/")
    result = agent.exec_result(tcp_agent.call(request))
    assert result.exit_code == 0
    lines = result.stdout.head.splitlines()
    assert lines[0] == "1000"
    assert "Read-only file system" in lines[2]
    assert lines[-1] == "done"


def test_argv_and_timeout_work_over_tcp(tcp_agent: Agent) -> None:
    argv = agent.exec_result(
        tcp_agent.call(protocol.exec_request(["printf", "%s|", "a b", "$HOME"], 10, 4096, "/"))
    )
    assert argv.stdout.head == "a b|$HOME|"
    slow = agent.exec_result(tcp_agent.call(protocol.exec_request("sleep 30", 0.5, 4096, "/")))
    assert slow.timed_out and slow.exit_code is None and "timeout" in slow.limits_hit


def test_read_file_works(tcp_agent: Agent) -> None:
    write = protocol.exec_request(
        "printf 'one\\ntwo\\nthree\\n' > notes.txt", 10, 4096, "/workspace"
    )
    assert agent.exec_result(tcp_agent.call(write)).exit_code == 0
    found = agent.read_file_result(
        tcp_agent.call(protocol.read_file_request("/workspace/notes.txt", 2, 3, 4096))
    )
    assert (found.text, found.start_line, found.end_line, found.total_lines) == (
        "two\nthree\n",
        2,
        3,
        3,
    )
    with pytest.raises(FileError) as missing:
        agent.read_file_result(tcp_agent.call(protocol.read_file_request("nope.txt", 1, None, 64)))
    assert missing.value.kind == "not_found"


def _logs_once_they_say(tcp_agent: Agent, text: str, timeout_s: float = 10) -> str:
    """The container's logs once they hold ``text``: Docker copies a container's output
    asynchronously, so a line written just before the reply may not be there yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        logs: str = tcp_agent.container.logs().decode()
        if text in logs or time.monotonic() > deadline:
            assert text in logs, logs[-2000:]
            return logs
        time.sleep(0.05)


def test_wrong_token_is_refused_and_logged(tcp_agent: Agent) -> None:
    touch = protocol.exec_request("touch /workspace/pwned", 10, 4096, "/")
    with pytest.raises(AgentUnauthorized, match="bad token"):
        tcp_agent.call(touch, token="guess")
    logs = _logs_once_they_say(tcp_agent, "wrong token")
    assert "refused a request" in logs
    check = protocol.exec_request("test -e /workspace/pwned && echo yes || echo no", 10, 64, "/")
    assert agent.exec_result(tcp_agent.call(check)).stdout.head == "no\n"


def test_missing_token_is_refused_and_logged(tcp_agent: Agent) -> None:
    request = protocol.exec_request("echo ran", 10, 4096, "/")
    with socket.create_connection((tcp_agent.ip, tcp_agent.port), timeout=10) as sock:
        sock.sendall(json.dumps(request).encode() + b"\n")
        reply = json.loads(sock.makefile("rb").readline())
    assert reply == {"ok": False, "kind": protocol.Refusal.UNAUTHORIZED, "error": "bad token"}
    _logs_once_they_say(tcp_agent, "missing token")


def test_port_checks_do_not_disturb_the_agent(tcp_agent: Agent) -> None:
    """The kubelet's readiness probe opens and closes a connection with no request."""
    for _ in range(3):
        with socket.create_connection((tcp_agent.ip, tcp_agent.port), timeout=10):
            pass
    assert "version" in tcp_agent.call(protocol.ping())


def test_commands_cannot_touch_the_agent_or_read_its_token(tcp_agent: Agent) -> None:
    """Whatever a command does to its own sandbox, the agent survives it: the rollout is
    scored, never discarded (docs/failure-model.md's agent-caused table)."""
    hostile = (
        "cat /opt/orchestrator/agent/token 2>&1 | head -c 200; "
        "kill -9 $(pgrep -f exec_agent) 2>&1 | head -c 200; "
        "kill -STOP $(pgrep -f exec_agent) 2>&1 | head -c 200; "
        "kill -9 -1"
    )
    result = agent.exec_result(tcp_agent.call(protocol.exec_request(hostile, 10, 4096, "/")))
    out = result.stdout.head + result.stderr.head
    assert "Permission denied" in out and "Operation not permitted" in out, out
    assert tcp_agent.token not in out
    assert "version" in tcp_agent.call(protocol.ping())
    again = agent.exec_result(tcp_agent.call(protocol.exec_request("echo alive", 10, 64, "/")))
    assert again.stdout.head == "alive\n"
