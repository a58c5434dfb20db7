"""Where a process's or a container's cgroup files are, on cgroup v1 (cgroupfs or systemd
driver) and v2: one place for the sandbox backend (its limits' counters), the daemons' CPU
weight (daemon_share.py) and the benchmarks (memory, CPU per container)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


def container_file(controller: str, container_id: str, v1: str, v2: str) -> Path | None:
    """A Docker container's cgroup file: ``v1`` under ``controller``'s hierarchy, else
    ``v2``; None when neither is there (a runtime that keeps no such cgroup)."""
    for path in (
        ROOT / controller / "docker" / container_id / v1,
        ROOT / controller / "system.slice" / f"docker-{container_id}.scope" / v1,
        ROOT / "docker" / container_id / v2,
        ROOT / "system.slice" / f"docker-{container_id}.scope" / v2,
    ):
        if path.exists():
            return path
    return None


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


def container_cpu_s(container_id: str) -> float | None:
    """CPU seconds the container's processes used, or None when it keeps no such count."""
    path = container_file("cpuacct", container_id, "cpuacct.usage", "cpu.stat")
    try:
        if path is None:
            return None
        if path.name == "cpuacct.usage":
            return int(path.read_text()) / 1e9
        stat = dict(line.split() for line in path.read_text().splitlines())
        return int(stat["usage_usec"]) / 1e6
    except (OSError, ValueError, KeyError):
        return None


def container_memory(container_id: str) -> tuple[int, int]:
    """The container's memory in use and its page cache, in bytes (0, 0 when unknown)."""
    usage = container_file("memory", container_id, "memory.usage_in_bytes", "memory.current")
    stat = container_file("memory", container_id, "memory.stat", "memory.stat")
    try:
        used = int(usage.read_text()) if usage else 0
        fields = dict(line.split() for line in stat.read_text().splitlines()) if stat else {}
    except (OSError, ValueError):
        return 0, 0
    cache = int(fields.get("cache", fields.get("file", "0")))
    return used, cache
