"""Each isolation property of a sandbox, with a test that tries to break it, on every
runtime available (runc always, gVisor's runsc when registered)."""

from __future__ import annotations

import re
import time
from typing import Any

import docker
import pytest

from orchestrator.config import Runtime
from orchestrator.sandbox.agent.agent_processes import RUN_AS
from orchestrator.sandbox.backend import ExecResult, SandboxHandle
from orchestrator.sandbox.docker.backend import DockerBackend

pytestmark = [pytest.mark.isolation, pytest.mark.xdist_group("isolation")]


def run(backend: DockerBackend, handle: SandboxHandle, command: str, **kw: Any) -> ExecResult:
    return backend.exec(
        handle,
        command,
        timeout_s=kw.get("timeout_s", 20),
        output_budget_bytes=kw.get("budget", 64 * 1024),
    )


def out(result: ExecResult) -> str:
    return result.stdout.head + result.stdout.tail


def err(result: ExecResult) -> str:
    return result.stderr.head + result.stderr.tail


def assert_healthy(backend: DockerBackend, handle: SandboxHandle) -> None:
    probe = backend.probe(handle)
    assert probe.alive and probe.agent_ok, probe
    result = run(backend, handle, "echo alive")
    assert out(result) == "alive\n", result


@pytest.fixture()
def sandbox(make_sandbox: Any, runtime: Runtime) -> SandboxHandle:
    handle: SandboxHandle = make_sandbox(runtime=runtime)
    return handle


@pytest.fixture()
def bystander(make_sandbox: Any, runtime: Runtime) -> SandboxHandle:
    handle: SandboxHandle = make_sandbox(runtime=runtime, rollout_id="bystander")
    return handle


def test_no_network(backend: DockerBackend, sandbox: SandboxHandle) -> None:
    # The host's own services listen on 127.0.0.1; inside the sandbox that is the
    # sandbox's private loopback, so nothing answers. Other addresses are unroutable.
    probe = (
        "import socket,sys\n"
        "for host, port in [('127.0.0.1', 6379), ('10.255.255.53', 53), ('8.8.8.8', 53)]:\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=2)\n"
        "        print('CONNECTED', host)\n"
        "    except OSError as e:\n"
        "        print('blocked', host, e.errno)\n"
    )
    result = run(backend, sandbox, f"python3 -c {shell_quote(probe)}")
    assert "CONNECTED" not in out(result), out(result)
    assert out(result).count("blocked") == 3, result
    interfaces = out(run(backend, sandbox, "ls /sys/class/net 2>/dev/null || cat /proc/net/dev"))
    assert "eth0" not in interfaces


def test_capabilities_dropped_and_no_new_privileges(
    backend: DockerBackend, sandbox: SandboxHandle, runtime: Runtime
) -> None:
    status = out(run(backend, sandbox, "cat /proc/self/status"))
    fields = dict(re.findall(r"^(\w+):\s+(\S+)", status, re.M))
    for cap in ("CapInh", "CapPrm", "CapEff"):
        assert int(fields[cap], 16) == 0, (cap, fields[cap])
    assert int(fields.get("CapAmb", "0"), 16) == 0
    if runtime == "runc":
        # Old gVisor refuses PR_CAPBSET_DROP; there the empty permitted set and
        # no-new-privileges are what keep commands from gaining capabilities.
        assert int(fields["CapBnd"], 16) == 0
    if "NoNewPrivs" in fields:
        assert fields["NoNewPrivs"] == "1"
    # Nothing to escalate with: no setuid helpers work, and root-only acts fail.
    result = run(backend, sandbox, "chown root /workspace; mknod /tmp/dev c 1 3; echo done")
    assert "Operation not permitted" in err(result), result


def test_commands_run_as_unprivileged_user(backend: DockerBackend, sandbox: SandboxHandle) -> None:
    assert out(run(backend, sandbox, "id -u; id -g; id -G; whoami")) == "1000\n1000\n1000\nagent\n"


def test_read_only_root_with_writable_tmp_and_workspace(
    backend: DockerBackend, sandbox: SandboxHandle
) -> None:
    for path in ("/etc/passwd", "/usr/bin/newfile", "/opt/orchestrator/exec_agent.py", "/x"):
        result = run(backend, sandbox, f"echo pwned >> {path} && echo WROTE")
        assert "WROTE" not in out(result), (path, result)
    result = run(
        backend, sandbox, "echo a > /tmp/t && echo b > /workspace/w && cat /tmp/t /workspace/w"
    )
    assert out(result) == "a\nb\n", result


def test_tmp_is_size_limited(make_sandbox: Any, backend: DockerBackend, runtime: Runtime) -> None:
    handle = make_sandbox(runtime=runtime, limits={"tmp_mb": 32, "memory_mb": 512})
    result = run(backend, handle, "dd if=/dev/zero of=/tmp/fill bs=1M count=64 2>&1; echo rc=$?")
    assert "No space left on device" in out(result), result
    assert_healthy(backend, handle)
    # Quietly, too: the sandbox sees the filesystem full after the command failed.
    assert run(backend, handle, "rm /tmp/fill").exit_code == 0
    quiet = run(backend, handle, "dd if=/dev/zero of=/tmp/fill bs=1M 2>/dev/null")
    assert quiet.limits_hit == ["disk"], quiet
    hit = quiet.limit("disk")
    assert hit is not None and hit.path == "/tmp" and hit.limit == 32 and hit.unit == "MB"
    assert_healthy(backend, handle)


def test_workspace_is_size_limited(
    make_sandbox: Any, backend: DockerBackend, runtime: Runtime
) -> None:
    handle = make_sandbox(runtime=runtime, limits={"disk_mb": 64})
    image = backend.workspaces.image_path(handle.sandbox_id)
    writer = (
        "python3 -c 'import os\n"
        'with open("/workspace/fill", "wb") as f:\n'
        "    while True: f.write(os.urandom(1 << 20))'"
    )
    result = run(backend, handle, writer, timeout_s=60)
    assert result.exit_code == 1 and "No space left on device" in err(result), result
    assert result.limits_hit == ["disk"], result
    hit = result.limit("disk")
    assert hit is not None and hit.path == "/workspace" and hit.limit == 64
    # The host's disk took no more than the cap, and the sandbox carries on.
    assert image.stat().st_blocks * 512 <= 65 << 20
    assert_healthy(backend, handle)
    assert run(backend, handle, "false").limits_hit == [], "a full disk is not every failure's"
    again = run(
        backend, handle, "rm /workspace/fill && echo ok > /workspace/small && cat /workspace/small"
    )
    assert out(again) == "ok\n" and again.limits_hit == [], again


def test_workspace_dies_with_the_sandbox(
    make_sandbox: Any, backend: DockerBackend, runtime: Runtime
) -> None:
    first = make_sandbox(runtime=runtime)
    assert run(backend, first, "echo secret > /workspace/left-behind").exit_code == 0
    backend.destroy(first)
    client = docker.from_env()
    try:
        volumes = {v.name for v in client.volumes.list()}
    finally:
        client.close()
    assert first.native_id not in volumes
    second = make_sandbox(runtime=runtime)
    assert out(run(backend, second, "ls /workspace")) == ""


def test_memory_limit_kills_the_command_not_the_sandbox(
    make_sandbox: Any, backend: DockerBackend, runtime: Runtime
) -> None:
    handle = make_sandbox(runtime=runtime, limits={"memory_mb": 128})
    hog = "python3 -c 'x = bytearray(512 * 1024 * 1024); print(len(x))'"
    result = run(backend, handle, hog)
    assert result.exit_code != 0, result
    assert "536870912" not in out(result)
    assert result.limits_hit == ["memory"], result
    hit = result.limit("memory")
    assert hit is not None
    if runtime == "runc":
        # The cgroup's OOM killer took the command.
        assert hit.killed and hit.limit == 128 and hit.unit == "MB", hit
    else:
        # gVisor: the allocation failed at the command's RLIMIT_AS (3/4 of the limit).
        assert not hit.killed and hit.limit == 96 and hit.unit == "MB per process", hit
    assert_healthy(backend, handle)


def _cgroup_cpu_ns(client: docker.DockerClient, handle: SandboxHandle) -> int:
    stats = client.api.stats(handle.native_id, stream=False, one_shot=True)
    return int(stats["cpu_stats"]["cpu_usage"]["total_usage"])


def test_cpu_limit_caps_cpu_time(
    make_sandbox: Any, backend: DockerBackend, client: docker.DockerClient, runtime: Runtime
) -> None:
    handle = make_sandbox(runtime=runtime, limits={"cpus": 0.25})
    # CPU time is read from the host's side (the cgroup the quota applies to): gVisor's
    # in-sandbox getrusage counts Sentry time, not what the host actually granted.
    # Two busy processes for 2 s of wall time may use at most ~0.5 s of CPU under the
    # quota; without it they would use up to 4 s on two cores. An upper bound: noise on a
    # shared machine can only lower it.
    burn = (
        "python3 -c '\n"
        "import os, time\n"
        "end = time.time() + 2\n"
        "pid = os.fork()\n"
        "while time.time() < end: pass\n"
        "if pid == 0: os._exit(0)\n"
        "os.wait()'"
    )
    before = _cgroup_cpu_ns(client, handle)
    started = time.monotonic()
    result = run(backend, handle, burn)
    wall = time.monotonic() - started
    cpu_seconds = (_cgroup_cpu_ns(client, handle) - before) / 1e9
    assert result.exit_code == 0, result
    # The quota grants 0.25 s per second of wall time; allow one period of slack per second.
    allowed = 0.25 * wall + 0.3
    assert cpu_seconds < allowed, f"{cpu_seconds:.2f} s CPU in {wall:.2f} s wall at 0.25 cpus"


def test_pids_limit_stops_a_fork_bomb(
    make_sandbox: Any, backend: DockerBackend, bystander: SandboxHandle, runtime: Runtime
) -> None:
    handle = make_sandbox(runtime=runtime, limits={"pids": 64})
    bomb = "bomb() { bomb | bomb & }; bomb; sleep 3"
    result = run(backend, handle, bomb, timeout_s=5)
    assert result.timed_out or result.exit_code is not None
    assert "pids" in result.limits_hit, result
    hit = result.limit("pids")
    assert hit is not None and hit.limit == 64 and hit.unit == "processes"
    # The bomb's processes are gone with its command; the sandbox and its neighbour work.
    time.sleep(0.5)
    assert_healthy(backend, handle)
    assert int(out(run(backend, handle, "ps -u agent --no-headers | wc -l")).strip()) <= 3
    assert_healthy(backend, bystander)


def test_output_budget_caps_a_flood(
    make_sandbox: Any, backend: DockerBackend, runtime: Runtime
) -> None:
    sandbox = make_sandbox(runtime=runtime, limits={"output_mb": 8})
    # Drained within the budget, then killed at the output limit: not left to run (and
    # burn a CPU) until its timeout.
    result = run(backend, sandbox, "yes", timeout_s=60, budget=4096)
    assert not result.timed_out and result.exit_code is None, result
    assert result.limits_hit == ["output"]
    hit = result.limit("output")
    assert hit is not None and hit.killed and hit.limit == 8 and hit.unit == "MB"
    assert result.stdout.truncated
    assert result.stdout.kept_bytes <= 4096
    assert result.stdout.total_bytes > 8 << 20
    assert result.stdout.head.startswith("y\ny\n") and result.stdout.tail.endswith("y\n")
    bounded = run(backend, sandbox, "head -c 1000000 /dev/zero | tr '\\0' x", budget=1000)
    assert bounded.stdout.total_bytes == 1_000_000
    assert bounded.stdout.kept_bytes == 1000
    assert not bounded.timed_out and bounded.exit_code == 0
    assert bounded.limits_hit == [], "output cut to the budget is no limit hit"
    assert_healthy(backend, sandbox)


def test_timeout_kills_the_whole_process_group(
    backend: DockerBackend, sandbox: SandboxHandle
) -> None:
    started = time.monotonic()
    result = run(
        backend,
        sandbox,
        "sleep 300 & (sleep 301 &) ; setsid sleep 302 & sleep 303",
        timeout_s=1,
    )
    elapsed = time.monotonic() - started
    assert result.timed_out and result.exit_code is None
    assert result.limits_hit == ["timeout"]
    assert elapsed < 5, elapsed
    left = out(run(backend, sandbox, "ps -u agent -o args= | grep -c '^sleep 30' || true"))
    assert left.strip() == "0", left


def test_background_processes_do_not_outlive_their_command(
    backend: DockerBackend, sandbox: SandboxHandle
) -> None:
    result = run(backend, sandbox, "sleep 300 & echo started")
    assert out(result) == "started\n" and not result.timed_out
    assert out(run(backend, sandbox, "pgrep -u agent -c sleep || true")).strip() == "0"


def test_commands_cannot_harm_the_exec_agent(
    backend: DockerBackend, sandbox: SandboxHandle
) -> None:
    attacks = [
        "kill -9 -1",
        "kill -9 1",
        "pkill -9 -f exec_agent; pkill -9 python3",
        "for p in $(pgrep -f exec_agent); do kill -9 $p; done",
        "ls /run/orchestrator",
        "python3 -c 'import socket; s=socket.socket(socket.AF_UNIX);"
        ' s.bind("/run/orchestrator/agent.sock")\'',
        "cp /bin/true /opt/orchestrator/exec_agent.py",
        # run-as runs as root until it switches: replacing it would be root's code.
        "cp /bin/sh /opt/orchestrator/bin/run-as; rm -f /opt/orchestrator/bin/run-as;"
        " mv /opt/orchestrator/bin /tmp/b; ln -s /tmp /opt/orchestrator/bin",
        "gdb -p 1 -batch 2>&1 | head -1; cat /proc/1/environ",
    ]
    for attack in attacks:
        run(backend, sandbox, attack, timeout_s=5)
        assert_healthy(backend, sandbox)
    agent_pids = out(run(backend, sandbox, "pgrep -f exec_agent.py")).split()
    assert agent_pids, "the exec agent should still be running"
    # Commands still start through the image's run-as, as the agent's user.
    assert out(run(backend, sandbox, "id -u; stat -c '%U %a' /opt/orchestrator/bin/run-as")) == (
        "1000\nroot 755\n"
    )


def test_commands_start_through_run_as(
    backend: DockerBackend, sandbox: SandboxHandle, client: docker.DockerClient
) -> None:
    """The agent found the image's run-as trustworthy and starts commands through it (a
    vfork, not a fork of the agent: sandbox_images/base/run-as/run_as.c)."""
    logs = client.containers.get(sandbox.native_id).logs().decode()
    assert f"through {RUN_AS}" in logs, logs


def test_destructive_commands_stay_inside_one_sandbox(
    make_sandbox: Any, backend: DockerBackend, bystander: SandboxHandle, runtime: Runtime
) -> None:
    victim = make_sandbox(runtime=runtime)
    run(backend, bystander, "echo mine > /workspace/keep")
    run(backend, victim, "rm -rf / 2>/dev/null; rm -rf /workspace/* /tmp/*", timeout_s=30)
    run(backend, victim, "rm -rf --no-preserve-root / 2>/dev/null", timeout_s=30)
    run(backend, victim, "kill -9 -1", timeout_s=5)
    run(backend, victim, "dd if=/dev/zero of=/tmp/fill bs=1M 2>/dev/null", timeout_s=10)
    run(backend, victim, "yes > /dev/null & yes > /dev/null & sleep 2", timeout_s=5)
    assert_healthy(backend, victim)
    assert_healthy(backend, bystander)
    assert out(run(backend, bystander, "cat /workspace/keep")) == "mine\n"
    assert out(run(backend, bystander, "ls /usr/bin/python3")) == "/usr/bin/python3\n"


def shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"
