"""The Docker daemons' share of the host's CPU, bounded so that seating a burst does not
slow the rollouts already running (issue 13, item 4).

dockerd and containerd, and the shims and OCI runtimes containerd starts, do a sandbox's
create, reset by restart and destroy, and almost nothing of a tool call: a call goes to the
exec agent's socket, and a probe asks dockerd one inspect. In a burst of 256 cold starts
on two cores, dockerd and containerd alone took 17.5 CPU-s (the shims and runtimes more),
in as many threads, each weighted like one of the worker's. Put in a cgroup of their own
with a low CPU weight, they get the whole host while nothing else wants it and only their
weight's share while running rollouts' calls do: a weight, unlike a quota, leaves no core
idle. Measured (bench/burst.py, 256 cold starts): later calls' p99 492 ms at the default
weight, 198-231 ms at 10, with no slower seating. Off by default (the setting is 0): probes
and the heartbeat ask dockerd too, and on a host saturated by other work (16 busy loops on
two cores, tests/e2e/test_overloaded_host.py) weight 10 starved dockerd until a pre-grade
probe timed out and a rollout was discarded.

Only processes the daemons start from then on inherit the cgroup (shims of containers
created since); containers themselves are put in their own cgroups by the runtime, so
the agent's commands never run at the daemons' weight. ``bound_daemons`` is idempotent;
the worker checks at every heartbeat and places them again when one restarted.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from pathlib import Path

from pydantic import BaseModel, Field

from orchestrator.sandbox.cgroups import cpu_cgroup, hierarchy

GROUP = "orchestrator-daemons"
"""The cgroup made for the daemons when they sit in the root cgroup (no systemd unit of
their own: a container, a CI machine, ``make up``'s own dockerd)."""

_V1_SHARES_PER_WEIGHT = 1024 / 100  # cgroup v1 cpu.shares default 1024, v2 cpu.weight 100


class DaemonShare(BaseModel):
    """What ``bound_daemons`` found and did: reported in the worker's heartbeat."""

    weight: int = Field(description="The CPU weight asked for (100: any other process's).")
    enforced: bool
    cgroups: list[str] = Field(default_factory=list, description="Where the daemons are.")
    pids: list[int] = Field(default_factory=list)
    detail: str = ""

    def daemons_alive(self, proc: Path = Path("/proc")) -> bool:
        """Whether every daemon this placed still runs (a restarted one must be placed
        again): one stat per daemon, cheap enough for every heartbeat."""
        return all((proc / str(pid)).exists() for pid in self.pids)


SYSTEM_CONTAINERD = Path("/run/containerd/containerd.sock")
"""Where a containerd that dockerd does not run itself listens (dockerd --containerd)."""


def peer_pid(socket_path: Path) -> int:
    """The pid of the process serving the Unix socket ``socket_path`` (SO_PEERCRED)."""
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(5)
        conn.connect(str(socket_path))
        cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, _uid, _gid = struct.unpack("3i", cred)
    return int(pid)


def children(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """``pid``'s child processes (every thread's ``children`` list)."""
    found: list[int] = []
    for task in (proc / str(pid) / "task").iterdir():
        # A thread that ended since the listing has no children left to tell.
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _comm(pid: int, proc: Path = Path("/proc")) -> str:
    """The process's name; "" when it ended since it was listed (dockerd's short-lived
    children, a proxy or a runtime call, come and go while we look)."""
    try:
        return (proc / str(pid) / "comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def daemon_pids(docker_socket: Path, proc: Path = Path("/proc")) -> list[int]:
    """The dockerd serving ``docker_socket``, and the containerd it works with: its own
    child, else the system's (:data:`SYSTEM_CONTAINERD`). Only these: other dockerds on
    the machine (a test's, another deployment's) are not this worker's."""
    dockerd = peer_pid(docker_socket)
    containerd = [c for c in children(dockerd, proc) if _comm(c, proc) == "containerd"]
    if not containerd and SYSTEM_CONTAINERD.exists():
        containerd = [peer_pid(SYSTEM_CONTAINERD)]
    return [dockerd, *containerd]


def bound_daemons(weight: int, docker_socket: Path) -> DaemonShare:
    """Give dockerd and containerd the CPU weight ``weight`` (cgroup v2's scale: 100 is a
    default process's; v1's cpu.shares get ``weight × 10.24``).

    The daemons are those of ``docker_socket`` (:func:`daemon_pids`). Daemons in the
    root cgroup are moved into :data:`GROUP`; daemons in a systemd unit of
    their own (``docker.service``) have that unit's weight set. Any other daemon is left
    alone: one in some container's cgroup (a Kubernetes node's) is not this host's, and
    one in the worker's own cgroup would take the worker's weight with it."""
    own = cpu_cgroup(os.getpid())
    placed: list[int] = []
    cgroups: set[str] = set()
    skipped: list[str] = []
    try:
        for pid in daemon_pids(docker_socket):
            version, path = cpu_cgroup(pid)
            root = hierarchy(version)
            if root is None:
                raise OSError(f"no {version} cpu cgroup hierarchy is mounted")
            if path in ("/", f"/{GROUP}"):
                group = root / GROUP
                _make_group(root, group, version)
                _set_weight(group, version, weight)
                if path == "/":
                    (group / "cgroup.procs").write_text(str(pid))
                cgroups.add(f"/{GROUP}")
            elif path.endswith(".service") and (version, path) != own:
                _set_weight(root / path.lstrip("/"), version, weight)
                cgroups.add(path)
            else:
                skipped.append(f"pid {pid} in {path}")
                continue
            placed.append(pid)
    except OSError as exc:
        return DaemonShare(weight=weight, enforced=False, pids=placed, detail=str(exc))
    detail = f"left alone: {', '.join(skipped)}" if skipped else ""
    return DaemonShare(
        weight=weight, enforced=bool(placed), cgroups=sorted(cgroups), pids=placed, detail=detail
    )


def _make_group(root: Path, group: Path, version: str) -> None:
    if version == "v2":
        # The root may hand the cpu controller down to its children (the "no internal
        # processes" rule does not hold at the root).
        control = root / "cgroup.subtree_control"
        if "cpu" not in control.read_text().split():
            control.write_text("+cpu")
    group.mkdir(exist_ok=True)


def _set_weight(group: Path, version: str, weight: int) -> None:
    if version == "v1":
        (group / "cpu.shares").write_text(str(max(2, round(weight * _V1_SHARES_PER_WEIGHT))))
    else:
        (group / "cpu.weight").write_text(str(weight))
