"""What a command hit: the sandbox's limits (memory, processes, disk, output; the timeout
is the command's own) told from cgroup counters, free space and what the command printed,
each with its value for the model. Part of the exec agent (exec_agent.py): standard library
only, Python 3.9+, put beside it in every sandbox."""

from __future__ import annotations

import errno
import os

MB = 1 << 20
# cgroup counters that rise when a limit stops the sandbox's processes: (file, key) per
# limit, cgroup v1 first, then v2. gVisor shows no cgroup files (its limits are per-process
# rlimits, see shell_wrapper); then the evidence comes from what the command printed.
CGROUP_COUNTERS = {
    "memory": [
        ("/sys/fs/cgroup/memory/memory.oom_control", "oom_kill"),
        ("/sys/fs/cgroup/memory.events", "oom_kill"),
    ],
    "pids": [
        ("/sys/fs/cgroup/pids/pids.events", "max"),
        ("/sys/fs/cgroup/pids.events", "max"),
    ],
}
# What programs print when an allocation fails (Python, glibc's strerror(ENOMEM), C++,
# bash, GCC/Go/Rust runtimes). Only read under per-process memory rlimits (gVisor): there
# an allocation past the limit fails instead of drawing the OOM killer.
OUT_OF_MEMORY_TEXT = (
    "MemoryError",
    "Cannot allocate memory",
    "std::bad_alloc",
    "out of memory",
    "memory exhausted",
    "failed to allocate",
    "memory allocation of",
)
# What programs print when fork or clone fails with EAGAIN: the process limit.
FORK_FAILED_TEXT = (
    "fork: retry",
    "fork: Resource temporarily unavailable",
    "Cannot fork",
    "can't fork",
    "BlockingIOError: [Errno 11]",
    "thread: Resource temporarily unavailable",
    "pthread_create failed",
    "failed to create new OS thread",
)
NO_SPACE_TEXT = ("No space left on device", "[Errno 28]", "Disk quota exceeded")
# A filesystem counts as full when less than this much of it is left (a writer that hit
# ENOSPC leaves less than one of its writes free), or when it has no free inode.
FULL_FRACTION = 0.02
FULL_MIN_BYTES = 1 * MB
FULL_MAX_BYTES = 8 * MB
# Share of the pids limit the agent's user must hold for a failed fork to be its doing.
PIDS_BLAME_SHARE = 0.5


def read_counter(path: str, key: str) -> int | None:
    """The value of ``key`` in a flat-keyed cgroup file, or None when unreadable.

    Read with one os.read (the files are a few short lines): 12 us a file instead of 21 us
    through open()'s text layers, in a runc sandbox; each command reads two, twice."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            raw = os.read(fd, 4096)
        finally:
            os.close(fd)
        wanted = key.encode()
        for line in raw.split(b"\n"):
            name, _, value = line.partition(b" ")
            if name == wanted:
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def find_counters() -> dict[str, tuple[str, str]]:
    """The cgroup counters this sandbox shows, by limit (none under gVisor)."""
    found = {}
    for limit, candidates in CGROUP_COUNTERS.items():
        for path, key in candidates:
            if read_counter(path, key) is not None:
                found[limit] = (path, key)
                break
    return found


def number(value: object) -> float | None:
    """A limit's value from the host's JSON; None when absent or not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


class Snapshot:
    """Counters and free space read just before a command starts."""

    def __init__(
        self,
        counters: dict[str, int | None],
        spaces: dict[str, tuple[int, int, int] | None],
    ) -> None:
        self.counters = counters
        self.spaces = spaces


def free_space(path: str) -> tuple[int, int, int] | None:
    """(free bytes for unprivileged users, total bytes, free inodes or -1 when the
    filesystem does not count them, like gVisor's tmpfs) of a filesystem."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    inodes = st.f_favail if st.f_files else -1
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize, inodes


def is_full(space: tuple[int, int, int]) -> bool:
    free, total, inodes = space
    threshold = min(FULL_MAX_BYTES, max(FULL_MIN_BYTES, int(total * FULL_FRACTION)))
    return free < threshold or inodes == 0


def user_tasks(uid: int) -> int:
    """Threads of every process of ``uid``: what the pids limit counts (RLIMIT_NPROC
    counts them too)."""
    count = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        fields = raw[raw.rfind(b")") + 2 :].split()
        count += int(fields[17]) if len(fields) > 17 else 1
    return count


def mentions(texts: list[str], needles: tuple[str, ...]) -> str | None:
    """The first of ``needles`` found in ``texts``, or None."""
    for needle in needles:
        for text in texts:
            if needle in text:
                return needle
    return None


def hit(
    kind: str,
    limit: float | None,
    unit: str,
    evidence: str,
    *,
    killed: bool = False,
    path: str | None = None,
) -> dict[str, object]:
    """One entry of an exec reply's ``limit_details``."""
    return {
        "kind": kind,
        "limit": limit,
        "unit": unit,
        "path": path,
        "killed": killed,
        "evidence": evidence,
    }


class Limits:
    """The sandbox's limits, as the host configured them, and how to tell that a command
    hit one. Everything here is evidence for the host; nothing here enforces a limit."""

    def __init__(
        self,
        config: dict[str, object],
        uid: int,
        limit_as_mb: int | None,
        limit_nproc: int | None,
    ) -> None:
        self.uid = uid
        self.memory_mb = number(config.get("memory_mb"))
        self.pids = number(config.get("pids"))
        self.output_mb = number(config.get("output_mb"))
        disks = config.get("disk")
        # Only filesystems with a limit of their own: a full uncapped one is the host's disk.
        self.disks = {
            str(path): mb
            for path, mb in (disks.items() if isinstance(disks, dict) else [])
            if isinstance(mb, int) and mb > 0
        }
        self.limit_as_mb = limit_as_mb
        self.limit_nproc = limit_nproc
        self.counters = find_counters()

    @property
    def output_bytes(self) -> int:
        """Output past which a command is killed; 0 for none."""
        return int(self.output_mb * MB) if self.output_mb else 0

    def snapshot(self) -> Snapshot:
        """What to compare against once a command is done: counters and free space."""
        counters = {kind: read_counter(*where) for kind, where in self.counters.items()}
        spaces = {path: free_space(path) for path in self.disks}
        return Snapshot(counters, spaces)

    def processes_at_limit(self, *, fork_failed: bool) -> str | None:
        """Under per-process rlimits (gVisor): evidence that the agent's user holds its
        process limit, read before the command's processes are killed; None if it does not.
        ``fork_failed``: the command's output says a fork failed with EAGAIN.

        A fork bomb's processes are born and die while /proc is walked, and under gVisor on
        a loaded host the walk is slow enough to miss many of them: one walk counted fewer
        than limit - 1 while the bomb's shells were printing "fork: retry", and the bomb was
        scored as a command that succeeded. So a failed fork in the output with at least
        PIDS_BLAME_SHARE of the limit held counts too (a log that merely mentions a failed
        fork does not come with dozens of the user's processes)."""
        if not self.limit_nproc:
            return None
        tasks = user_tasks(self.uid)
        if tasks >= self.limit_nproc - 1:
            return f"the agent's user held its RLIMIT_NPROC of {self.limit_nproc}"
        if fork_failed and tasks >= self.limit_nproc * PIDS_BLAME_SHARE:
            return (
                f"fork failed with EAGAIN while the agent's user ran {tasks} tasks "
                f"under RLIMIT_NPROC {self.limit_nproc}"
            )
        return None

    def hits(
        self, before: Snapshot, *, failed: bool, texts: list[str], nproc_full: str | None
    ) -> list[dict[str, object]]:
        """The memory, pids and disk limits a finished command hit. ``failed``: it ended
        with a non-zero status, a signal or a kill; ``texts``: its captured output;
        ``nproc_full``: evidence that it held its process limit (processes_at_limit)."""
        rose = {}
        for kind, where in self.counters.items():
            now = read_counter(*where)
            was = before.counters.get(kind)
            if now is not None and was is not None and now > was:
                rose[kind] = f"{where[0]} {where[1]} {was} -> {now}"
        found = []
        if "memory" in rose:
            found.append(hit("memory", self.memory_mb, "MB", rose["memory"], killed=True))
        elif self.limit_as_mb and failed:
            text = mentions(texts, OUT_OF_MEMORY_TEXT)
            if text:
                evidence = f"allocation failed ({text!r}) under RLIMIT_AS {self.limit_as_mb} MB"
                found.append(hit("memory", self.limit_as_mb, "MB per process", evidence))
        if "pids" in rose:
            found.append(hit("pids", self.pids, "processes", rose["pids"]))
        elif nproc_full:
            found.append(hit("pids", self.pids, "processes", nproc_full))
        elif self.limit_nproc and failed:
            text = mentions(texts, FORK_FAILED_TEXT)
            if text:
                evidence = f"fork failed ({text!r}) under RLIMIT_NPROC {self.limit_nproc}"
                found.append(hit("pids", self.pids, "processes", evidence))
        if failed:
            found += self._disk_hits(before, texts)
        return found

    def _disk_hits(self, before: Snapshot, texts: list[str]) -> list[dict[str, object]]:
        said = mentions(texts, NO_SPACE_TEXT)
        filled, full = [], []
        for path, mb in self.disks.items():
            now = free_space(path)
            if now is None or not is_full(now):
                continue
            was = before.spaces.get(path)
            evidence = f"{now[0]} bytes free of {now[1]}"
            if now[2] >= 0:
                evidence += f", {now[2]} inodes free"
            entry = hit("disk", mb, "MB", evidence, path=path)
            if was is not None and (now[0] < was[0] or now[2] < was[2]):
                filled.append(entry)
            full.append(entry)
        # Full, and this command filled it; or full and the command was refused space (a
        # full disk alone does not make every later failing command the disk's fault).
        return filled or (full if said else [])

    def spawn_failure(self, exc: OSError) -> dict[str, object]:
        """The reply when the command could not even start. EAGAIN with the agent's user
        holding at least half of the process limit is that user's doing: the limit is
        full of its own processes (left behind with setsid, or of concurrent commands)."""
        reply: dict[str, object] = {"spawn_error": f"{type(exc).__name__}: {exc}"}
        limit = self.limit_nproc or self.pids
        if exc.errno != errno.EAGAIN or not limit:
            return reply
        tasks = user_tasks(self.uid)
        if tasks >= limit * PIDS_BLAME_SHARE:
            evidence = f"fork failed with EAGAIN while the agent's user ran {tasks} tasks"
            reply["limits_hit"] = ["pids"]
            reply["limit_details"] = [hit("pids", self.pids, "processes", evidence)]
        return reply
