"""The Docker daemons' share of the host's CPU, bounded so that seating a burst does not
slow the rollouts already running (issue 13, item 4).

dockerd and containerd, and the shims and OCI runtimes containerd starts, do a sandbox's
create, reset by restart and destroy, and almost nothing of a tool call: a call goes to the
exec agent's socket, and a probe asks dockerd one inspect. In a burst on two cores they
burned 0.19 CPU-s per create (bench/results/burst.md), as many threads each weighted like
one of the worker's. Put in a cgroup of their own with a low CPU weight, they get the whole
host while nothing else wants it and only their weight's share while running rollouts'
calls do: a weight, unlike a quota, leaves no core idle.

Only processes the daemons start from then on inherit the cgroup (shims of containers
created since); containers themselves are put in their own cgroups by the runtime, so
the agent's commands never run at the daemons' weight. ``bound_daemons`` is idempotent,
and cheap once done: the worker calls it at start and again when a daemon restarted.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, Field

DAEMONS = ("dockerd", "containerd")
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


def daemon_pids(proc: Path = Path("/proc")) -> list[int]:
    """The pids of the processes named in :data:`DAEMONS` (a scan of ``/proc``)."""
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue  # gone since the listing
        if name in DAEMONS:
            found.append(int(entry.name))
    return sorted(found)


def cpu_cgroup(pid: int) -> tuple[str, str]:
    """``(version, path)`` of ``pid``'s CPU cgroup: ("v1", path in the cpu hierarchy) or
    ("v2", path in the unified one)."""
    unified = ""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return "v1", path
        if controllers == "":
            unified = path
    return "v2", unified


def hierarchy(version: str) -> Path | None:
    """Where the cpu controller's hierarchy (v1) or the unified hierarchy (v2) is mounted."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, filesystem = line.partition(" - ")
        fstype, _source, options = filesystem.split(" ", 2)
        mount_point = Path(fields.split(" ")[4])
        if version == "v1" and fstype == "cgroup" and "cpu" in options.split(","):
            return mount_point
        if version == "v2" and fstype == "cgroup2":
            return mount_point
    return None


def bound_daemons(weight: int) -> DaemonShare:
    """Give dockerd and containerd the CPU weight ``weight`` (cgroup v2's scale: 100 is a
    default process's; v1's cpu.shares get ``weight × 10.24``).

    Daemons in the root cgroup are moved into :data:`GROUP`; daemons in a systemd unit of
    their own (``docker.service``) have that unit's weight set. Any other daemon is left
    alone: one in some container's cgroup (a Kubernetes node's) is not this host's, and
    one in the worker's own cgroup would take the worker's weight with it."""
    own = cpu_cgroup(os.getpid())
    placed: list[int] = []
    cgroups: set[str] = set()
    skipped: list[str] = []
    try:
        for pid in daemon_pids():
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
    if not placed:
        detail = detail or "no dockerd or containerd here"
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
