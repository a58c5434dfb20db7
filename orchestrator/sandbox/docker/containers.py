"""What a sandbox's container is made of (pure): where the host's pieces are mounted in
it, its tmpfs trees, the exec agent's command line, its cgroup process limit."""

from __future__ import annotations

from orchestrator.sandbox.agent import (
    AGENT_LOADER,
    HOME_MB,
    SANDBOX_HOME,
    SANDBOX_UID,
    agent_arguments,
)
from orchestrator.sandbox.backend import SandboxSpec

SOCKET_DIR_IN_SANDBOX = "/run/orchestrator"
AGENT_DIR_IN_SANDBOX = "/opt/orchestrator"
"""Where the agent's modules are, side by side (sandbox/agent/__init__.AGENT_MODULES)."""
AGENT_IN_SANDBOX = f"{AGENT_DIR_IN_SANDBOX}/exec_agent.py"
# The agent's bytecode, compiled on the host (sandbox/agent/__init__.compiled_agent).
AGENT_CACHE_IN_SANDBOX = f"{AGENT_DIR_IN_SANDBOX}/__pycache__"
SOCKET_NAME = "agent.sock"


def tmpfs(spec: SandboxSpec) -> dict[str, str]:
    """The sandbox's tmpfs trees and their mount options: /tmp, the user's home, and the
    environment's scratch directories (the sandbox user's, like its home; exec, Docker's
    default being noexec, as for /workspace: their scripts run)."""
    uid = SANDBOX_UID
    return {
        "/tmp": f"rw,nosuid,nodev,size={spec.limits.tmp_mb}m,mode=1777",
        SANDBOX_HOME: f"rw,nosuid,nodev,size={HOME_MB}m,uid={uid},gid={uid}",
        **{
            d.path: f"rw,exec,nosuid,nodev,size={d.size_mb}m,mode=0755,uid={uid},gid={uid}"
            for d in spec.scratch_dirs
        },
    }


def agent_command(spec: SandboxSpec, *, disk_mb: int, output_mb: int) -> list[str]:
    """The container's command: the exec agent (loaded as a module, so its bytecode is
    read from the cache the host mounts), listening on its socket."""
    return [
        "python3",
        "-I",
        "-S",
        "-c",
        AGENT_LOADER,
        AGENT_IN_SANDBOX,
        "--socket",
        f"{SOCKET_DIR_IN_SANDBOX}/{SOCKET_NAME}",
        *agent_arguments(spec, disk_mb=disk_mb, output_mb=output_mb),
    ]


def host_pids_limit(spec: SandboxSpec) -> int:
    """The cgroup pids limit. Under gVisor it counts the sandbox kernel's own host threads,
    which grow with the guest's processes; hitting it crashes the whole sandbox. So there
    the guest's process count is limited inside (RLIMIT_NPROC, see the agent) and the
    cgroup limit is only a generous backstop."""
    if spec.runtime == "runsc":
        return spec.limits.pids * 64 + 1024
    return spec.limits.pids
