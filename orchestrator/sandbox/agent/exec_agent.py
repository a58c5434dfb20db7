"""Exec agent: the first process of every sandbox, answering over a Unix socket (Docker)
or over TCP with a per-sandbox token (Kubernetes pods, see docs/kubernetes-backend.md).

Runs *inside* the sandbox with the image's own python3, so it uses the standard library only
and must stay compatible with Python 3.9+. One JSON request per connection, one JSON reply.

Why it exists: ``docker exec`` costs ~40 ms per call; a resident process answers in ~1 ms.

Why it cannot be harmed by the commands it runs: it runs as root holding only SETUID,
SETGID and KILL (the container drops every other capability and sets no-new-privileges),
drops its whole capability bounding set at start, and runs every command as the
unprivileged user in a new session (through run-as, :data:`RUN_AS`, when the image has a
trusted one: a vfork instead of a fork of the agent). A process of that user can neither
signal a root process (no CAP_KILL), nor ptrace it, nor reach the socket directory
(root-owned, 0700), nor write this file (read-only bind mount on a read-only root
filesystem).

The same holds in a Kubernetes pod (the container runs the agent as root with just those
capabilities). There it listens on TCP: other pods cannot call it without the sandbox's
token (read from a root-only file, compared in constant time), and the sandbox's
NetworkPolicy keeps every other network peer out.
"""

from __future__ import annotations

import argparse
import base64
import collections
import ctypes
import errno
import grp
import json
import os
import pwd
import re
import selectors
import shutil
import signal
import socketserver
import stat
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone

# Every sandbox's start pays for the agent's imports (about 40% of the CPU a sandbox uses
# starting up, bench/create_cost.py): modules the start does not need are imported where
# they are used (hmac: the TCP token check; shutil: removing a directory tree), and typing
# only for the type checker.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, TypeAlias

    # A running command: started by run-as (Spawned) or, without one, by subprocess.
    Command: TypeAlias = "subprocess.Popen[bytes] | Spawned"

    from orchestrator.sandbox.agent import agent_protocol as protocol
else:
    try:  # in a sandbox: the file beside this one (its directory is first on sys.path)
        import agent_protocol as protocol
    except ImportError:  # imported on the host (run-as's constants, tests)
        from orchestrator.sandbox.agent import agent_protocol as protocol

# A request is one JSON line: a file written through the "files" op travels in it (base64).
MAX_REQUEST_BYTES = 48 << 20
READ_CHUNK = 65536
# How long a finished command's background children may keep its pipes open before the
# process group is killed: commands must not leave processes behind.
DRAIN_AFTER_EXIT_S = 0.1
# Without a pidfd (old gVisor), how often a running command is polled for its exit, and
# the first interval once its streams have closed (doubling up to POLL_S).
POLL_S = 0.005
POLL_AFTER_CLOSE_S = 0.0002
PR_CAPBSET_DROP = 24
WORKSPACE = "/workspace"
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
# Raises the command's OOM score so the kernel picks the agent's commands, never the agent,
# then runs the command in the requested directory. The directory arrives as $1 and the
# command as the next $1 (a shell command line) or as "$@" (an argv, for configured tools):
# never interpolated into the script text. $0 is "bash", so errors read "bash: ...".
WRAPPER_PREFIX = 'printf 1000 > /proc/self/oom_score_adj 2>/dev/null; cd -- "$1" || exit 1; shift; '
RUN_SHELL = 'eval "$1"'
RUN_ARGV = 'exec "$@"'
# The setuid helper commands start through (sandbox_images/base/run-as/run_as.c): with it a
# command costs a vfork and two execs; without it, subprocess forks the whole agent to
# switch users (runc: `true` 2.8 ms in the agent, 1.2 ms through run-as; gVisor: ~20 ms
# against ~10 ms). Used only when root owns it and every directory above it, and nobody
# else may write any of them (:func:`trusted_run_as`): else the agent's user could replace
# what the agent runs as root.
RUN_AS = "/opt/orchestrator/bin/run-as"
# The descriptor run-as reports a failed switch or exec on (Popen's errpipe, as an errno).
RUN_AS_ERROR_FD = 3


def shell_wrapper(limit_as_mb: int | None, limit_nproc: int | None) -> str:
    """The wrapper, with per-process limits first where the sandbox needs them.

    Under gVisor the sandbox's memory and pids limits apply to the whole sandbox kernel:
    hitting them kills the sandbox, agent included, which would look like an infrastructure
    failure. Per-process limits inside the sandbox make the agent's command fail instead.
    (Not under runc: there the kernel's cgroup limits already hit the command alone, and
    RLIMIT_NPROC would count the same uid's processes in every other container.)
    """
    limits = []
    if limit_as_mb:
        limits.append(f"ulimit -v {int(limit_as_mb) * 1024}")
    if limit_nproc:
        limits.append(f"ulimit -u {int(limit_nproc)}")
    return "".join(f"{limit} 2>/dev/null; " for limit in limits) + WRAPPER_PREFIX


class Capture:
    """Keeps the first and last ``budget / 2`` bytes of a stream and counts the rest."""

    def __init__(self, budget: int) -> None:
        self.head_limit = budget - budget // 2
        self.tail_limit = budget // 2
        self.head = bytearray()
        self.tail: collections.deque[bytes] = collections.deque()
        self.tail_len = 0
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data or self.tail_limit == 0:
            return
        data = data[-self.tail_limit :]
        self.tail.append(data)
        self.tail_len += len(data)
        while self.tail_len - len(self.tail[0]) >= self.tail_limit:
            self.tail_len -= len(self.tail.popleft())

    def text(self) -> str:
        """What is kept so far, head and tail run together (for looking for messages)."""
        return (bytes(self.head) + b"".join(self.tail)).decode("utf-8", "replace")

    def result(self) -> dict[str, object]:
        tail = b"".join(self.tail)
        excess = self.tail_len - self.tail_limit
        if excess > 0:
            tail = tail[excess:]
        if len(self.head) + len(tail) == self.total:
            # Nothing was cut: decode as one piece so a character spanning the head/tail
            # seam survives.
            self.head += tail
            tail = b""
        return {
            "head": bytes(self.head).decode("utf-8", "replace"),
            "tail": tail.decode("utf-8", "replace"),
            "total_bytes": self.total,
            "kept_bytes": len(self.head) + len(tail),
        }


def drop_bounding_set() -> None:
    """Empty the capability bounding set so nothing this agent starts can regain a cap."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read().strip())
    except (OSError, ValueError):
        last = 63  # gVisor has no cap_last_cap: walk until the kernel says EINVAL
    for cap in range(last + 1):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            if ctypes.get_errno() == errno.EINVAL and cap > 0:
                return
            # Commands still run with no permitted or effective capabilities under
            # no-new-privileges, so they cannot gain any; the bounding set is a second lock.
            reason = os.strerror(ctypes.get_errno())
            log(f"cannot drop capability {cap} from the bounding set: {reason}")
            return


# capget(2)/capset(2): version 3 of the header, two 32-bit words of each set.
LINUX_CAPABILITY_VERSION_3 = 0x20080522
CAP_SETGID = 6
CAP_SETUID = 7


def keep_inheritable() -> None:
    """Hold CAP_SETUID and CAP_SETGID in the inheritable set, so run-as gets them at its
    exec (the emptied bounding set gives an exec'd root nothing else; it must be called
    before :func:`drop_bounding_set`, since only caps in the bounding set can be made
    inheritable). run-as clears every set before it runs the command
    (sandbox_images/base/run-as/run_as.c). Raises OSError when the kernel refuses."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inheritable")]

    libc = ctypes.CDLL(None, use_errno=True)
    header = Header(LINUX_CAPABILITY_VERSION_3, 0)
    data = (Data * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget failed")
    data[0].inheritable = data[0].permitted & ((1 << CAP_SETUID) | (1 << CAP_SETGID))
    data[1].inheritable = 0
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, pgrp) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    return int(fields[1]), int(fields[2])


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = proc_stat(int(name))
            if stat:
                children[stat[0]].append(int(name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def kill_group(pgid: int) -> None:
    """SIGKILL a process group until it is empty (members forking meanwhile included)."""
    for _ in range(100):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:  # ESRCH: the group is empty
            return
        time.sleep(0.002)


def kill_tree(pid: int) -> None:
    """SIGKILL a running command: its process group and every process descended from it,
    including those that left the group with setsid."""
    tree = descendants(pid)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    for child in tree:
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass


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


def trusted_run_as(path: str) -> str | None:
    """``path`` if it is a safe run-as: a regular executable file (not a symlink) that
    root owns, in directories root owns, none of them writable by group or others.
    None otherwise (absent, as in an image not built from ours, or unsafe)."""
    if not path or not os.path.isabs(path):
        return None
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or not st.st_mode & stat.S_IXUSR:
            return None
        parts = os.path.dirname(path).split("/")
        chain = [st] + [os.lstat("/".join(parts[:i]) or "/") for i in range(len(parts), 0, -1)]
    except OSError:
        return None
    for entry in chain:
        if entry.st_uid != 0 or entry.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None
    return path


def above_stdio(fd: int) -> int:
    """``fd`` itself, or a close-on-exec copy of it above the descriptors a command is
    given (0-2, and run-as's error pipe), so the spawn's dup2s cannot overwrite it."""
    if fd > RUN_AS_ERROR_FD:
        return fd
    import fcntl

    copy = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, RUN_AS_ERROR_FD + 1)
    os.close(fd)
    return copy


class Spawned:
    """A command started through run-as: the part of subprocess.Popen the agent uses
    (``pid``, ``stdout``, ``stderr``, ``poll``, ``wait``, ``returncode``: negative for a
    signal, as Popen's). ``poll`` and ``wait`` may be called from two threads (a
    ``signal`` request polls while the exec's own thread waits)."""

    def __init__(
        self, pid: int, stdout: Any, stderr: Any, stdin: Any = None, terminal: bool = False
    ) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.stdin = stdin
        self.terminal = terminal  # on a PTY: stdin and stdout are its master
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self) -> int:
        code = self._reap(0)
        assert code is not None
        return code

    def _reap(self, flags: int) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, flags)
                except ChildProcessError:  # reaped elsewhere: nothing else waits for it
                    pid, status = self.pid, 255 << 8
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode


def _spawn_through_run_as(
    run_as: str,
    uid: int,
    gid: int,
    argv: list[str],
    env: dict[str, str],
    stdio: list[tuple[Any, ...]],
    child_ends: tuple[int, ...],
    parent_ends: tuple[int, ...],
) -> int:
    """posix_spawn run-as (the agent is vforked, not forked) in a new session with the
    ``stdio`` file actions, and wait for its exec: the pid once it succeeded. The
    descriptors the child took (``child_ends``) are closed here either way; on a failure
    to start (EAGAIN at the pids limit, a failed switch or exec), ``parent_ends`` are
    closed too and the OSError Popen would raise is raised."""
    errpipe_r, errpipe_w = os.pipe()
    errpipe_w = above_stdio(errpipe_w)
    try:
        pid = os.posix_spawn(
            run_as,
            [run_as, str(uid), str(gid), *argv],
            env,
            file_actions=[*stdio, (os.POSIX_SPAWN_DUP2, errpipe_w, RUN_AS_ERROR_FD)],
            setsid=True,
            # What Popen's restore_signals gives back: Python ignores both.
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
            setsigmask=(),
        )
    except BaseException:
        for fd in (*parent_ends, errpipe_r):
            os.close(fd)
        raise
    finally:
        for fd in (*child_ends, errpipe_w):
            os.close(fd)
    with os.fdopen(errpipe_r, "rb", buffering=0) as errpipe:
        failed = errpipe.read(4)  # empty once the exec succeeded (close-on-exec)
    if failed:
        os.waitpid(pid, 0)
        for fd in parent_ends:
            os.close(fd)
        code = int.from_bytes(failed, sys.byteorder)
        raise OSError(code, f"{os.strerror(code)}: {argv[0]!r} as uid {uid}")
    return pid


def spawn_on_terminal(
    run_as: str, uid: int, gid: int, argv: list[str], env: dict[str, str], rows: int, cols: int
) -> Spawned:
    """Start ``argv`` as ``uid``:``gid`` through run-as on a new pseudo-terminal of
    ``rows`` x ``cols``, its controlling terminal (a new session opens it: posix_spawn's
    setsid comes before its file actions): its input and output are the terminal's master
    (``stdin``, ``stdout``; ``stderr`` is empty), its size set by :func:`set_terminal_size`."""
    master, slave = os.openpty()
    try:
        set_terminal_size(master, rows, cols)
        path = os.ttyname(slave)
    finally:
        os.close(slave)
    err_r, err_w = os.pipe()
    os.close(err_w)  # no standard error of its own: the terminal has both
    terminal = [
        (os.POSIX_SPAWN_OPEN, 0, path, os.O_RDWR, 0),
        (os.POSIX_SPAWN_DUP2, 0, 1),
        (os.POSIX_SPAWN_DUP2, 0, 2),
    ]
    pid = _spawn_through_run_as(run_as, uid, gid, argv, env, terminal, (), (master, err_r))
    return Spawned(
        pid,
        os.fdopen(master, "rb", buffering=0),
        os.fdopen(err_r, "rb", buffering=0),
        os.fdopen(os.dup(master), "wb", buffering=0),
        terminal=True,
    )


def set_terminal_size(fd: int, rows: int, cols: int) -> None:
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def spawn_as(
    run_as: str, uid: int, gid: int, argv: list[str], env: dict[str, str], stdin: bool = False
) -> Spawned:
    """Start ``argv`` as ``uid``:``gid`` in a new session, through run-as, with standard
    input from /dev/null (or a pipe, its ``stdin``) and standard output and error piped:
    what the Popen in :meth:`Agent.exec` does. A failure to start raises the OSError
    Popen would."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    out_w, err_w = above_stdio(out_w), above_stdio(err_w)
    source: tuple[Any, ...] = (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0)
    child_ends: tuple[int, ...] = (out_w, err_w)
    parent_ends: tuple[int, ...] = (out_r, err_r)
    in_w = -1
    if stdin:
        in_r, in_w = os.pipe()
        in_r = above_stdio(in_r)
        source = (os.POSIX_SPAWN_DUP2, in_r, 0)
        child_ends, parent_ends = (*child_ends, in_r), (*parent_ends, in_w)
    stdio = [source, (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)]
    pid = _spawn_through_run_as(run_as, uid, gid, argv, env, stdio, child_ends, parent_ends)
    return Spawned(
        pid,
        os.fdopen(out_r, "rb", buffering=0),
        os.fdopen(err_r, "rb", buffering=0),
        os.fdopen(in_w, "wb", buffering=0) if stdin else None,
    )


class Agent:
    """Runs commands and reads files as ``uid``/``gid``, never as itself."""

    def __init__(
        self,
        uid: int,
        gid: int,
        home: str,
        preload: str | None,
        wrapper: str,
        limits: Limits,
        run_as: str | None = None,
    ) -> None:
        self.uid = uid
        self.run_as = run_as
        self.gid = gid
        self.home = home
        self.wrapper = wrapper
        self.limits = limits
        # Commands started with an exec_id, so a "signal" request can reach them.
        self.running: dict[str, Command] = {}
        self.running_lock = threading.Lock()
        self.env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": home,
            "USER": "agent",
            "LOGNAME": "agent",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "TERM": "dumb",
            "PAGER": "cat",
            "GIT_PAGER": "cat",
            "NO_COLOR": "1",
        }
        if preload:
            self.env["LD_PRELOAD"] = preload

    def ping(self, _req: dict[str, object]) -> dict[str, object]:
        return {"version": protocol.VERSION, "pid": os.getpid(), "time": time.time()}

    def manifest(self, _req: dict[str, object]) -> dict[str, object]:
        """Everywhere state can outlive a rollout, as the host compares it with a fresh
        sandbox's before the sandbox serves another (:func:`sandbox_manifest`)."""
        return sandbox_manifest()

    def scrub(self, req: dict[str, object]) -> dict[str, object]:
        """The sandbox's half of a reset in place (the host renews /workspace): every
        process of the agent's user ended, its System V IPC objects removed, every writable
        tree but /workspace emptied of what the user put there, and the trees' roots given
        back the modes ``modes`` names (a fresh sandbox's). ``processes``: those that
        outlived ``timeout_s``, which fail the reset; the host's audit that follows judges
        the rest."""
        left = end_processes_of(self.uid, float(req.get("timeout_s") or 10))  # type: ignore[arg-type]
        if left:
            return {"processes": left}
        modes = {str(k): int(v) for k, v in dict(req.get("modes") or {}).items()}  # type: ignore[call-overload]
        points = writable_trees(mount_table())

        def as_user(_req: dict[str, object]) -> dict[str, object]:
            kept = [path for point in points for path in empty_tree(point)]
            for point in points:
                if point in modes and os.lstat(point).st_uid == self.uid:
                    os.chmod(point, modes[point])
            return {"ipc": remove_sysv_ipc(), "kept": kept}

        done = self._as_user({}, as_user)
        for point in points:  # the roots that are root's (/tmp): as root, their owner
            if point in modes and os.lstat(point).st_uid == 0:
                os.chmod(point, modes[point])
        return {"processes": [], **done}

    def stage(self, req: dict[str, object]) -> dict[str, object]:
        """Set /workspace up for a judgement of the agent's work (a grader's tests): every
        process of the agent's user ended first, so nothing of the agent's runs or writes
        while its work is judged; then, as the agent's user (its own files, and nothing a
        symbolic link of its making could lead a root write to), under /workspace and
        outside ``.git``: every file named in ``purge`` (or ending in one of ``purge``'s
        ``*.suffix`` entries) whose path is not in ``keep`` removed, each of ``remove``
        removed, each of ``write`` (path -> base64 contents) written in place of whatever
        was there. ``processes``: those that outlived ``timeout_s``; ``no_space``: a write
        failed for want of space (the agent filled its workspace)."""
        left = end_processes_of(self.uid, float(req.get("timeout_s") or 10))  # type: ignore[arg-type]
        if left:
            return {"processes": left}
        return self._as_user(req, stage_files)

    def pack(self, req: dict[str, object]) -> dict[str, object]:
        """What the sandbox's user left in its writable trees but /workspace (/tmp, its
        home, scratch directories: memory the host cannot read under gVisor), as that user
        reads it, into one tar file at ``to``, which only root here may write (the socket
        directory): a snapshot's half beside /workspace's upper layer, which the host
        copies (sandbox/docker/snapshots.py). ``skipped``: what the user could not read."""
        points = user_trees()
        fd = os.open(str(req["to"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            return self._as_user(req, lambda _r: pack_trees(points, fd))
        finally:
            os.close(fd)

    def unpack(self, req: dict[str, object]) -> dict[str, object]:
        """A :meth:`pack` file (at ``path``) extracted as the sandbox's user, into its
        writable trees only: a sandbox made from a snapshot gets back what its parent's
        user had there."""
        points = user_trees()
        fd = os.open(str(req["path"]), os.O_RDONLY | os.O_NOFOLLOW)
        try:
            return self._as_user(req, lambda _r: unpack_trees(points, fd))
        finally:
            os.close(fd)

    def exec(self, req: dict[str, object], emit: Any = None) -> dict[str, object]:
        """Run a command; with ``emit``, its output is also given to ``emit(stream, data)``
        as it is read, up to the budget per stream (what is kept is the same either way)."""
        cwd = str(req.get("cwd") or WORKSPACE)
        argv = req.get("argv")
        if argv is not None:
            if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
                raise ValueError("argv must be a non-empty list of strings")
            args = [self.wrapper + RUN_ARGV, "bash", cwd, *argv]
        else:
            args = [self.wrapper + RUN_SHELL, "bash", cwd, str(req["command"])]
        timeout = float(req["timeout_s"])  # type: ignore[arg-type]
        budget = int(req["budget"])  # type: ignore[call-overload]
        env = self.env
        extra = req.get("env")
        if extra:
            env = {**self.env, **checked_env(extra)}
        exec_id = req.get("exec_id")
        started = time.monotonic()
        before = self.limits.snapshot()
        terminal = req.get("pty")
        try:
            if isinstance(terminal, dict):
                if self.run_as is None:
                    raise ValueError("a PTY needs the image's run-as (a newer base image)")
                proc: Command = spawn_on_terminal(
                    self.run_as, self.uid, self.gid, ["/bin/bash", "-c", *args], env,
                    int(terminal["rows"]), int(terminal["cols"]),
                )  # fmt: skip
            else:
                proc = self._start(["/bin/bash", "-c", *args], env, stdin=bool(req.get("stdin")))
        except OSError as exc:
            # EAGAIN here is usually the sandbox's pids limit, hit by the agent's own
            # processes; spawn_failure says whether they fill it.
            return self.limits.spawn_failure(exc)
        captures = {proc.stdout: Capture(budget), proc.stderr: Capture(budget)}
        if isinstance(exec_id, str):
            with self.running_lock:
                self.running[exec_id] = proc
        try:
            names = {proc.stdout: "pty" if terminal else "stdout", proc.stderr: "stderr"}
            streams = (names, budget, emit) if emit is not None else None
            killed_for, nproc_full = self._wait(proc, captures, started + timeout, streams)
        finally:
            if isinstance(exec_id, str):
                with self.running_lock:
                    self.running.pop(exec_id, None)
        duration_ms = (time.monotonic() - started) * 1000
        returncode = proc.wait()  # reaped by _wait: this reads it
        sig = -returncode if returncode < 0 else None
        stdout = captures[proc.stdout].result()
        stderr = captures[proc.stderr].result()
        texts = [str(c[part]) for c in (stdout, stderr) for part in ("head", "tail")]
        details = self.limits.hits(
            before,
            failed=killed_for is not None or returncode != 0,
            texts=texts,
            nproc_full=nproc_full,
        )
        if killed_for == "output":
            total = sum(c.total for c in captures.values())
            evidence = f"{total} bytes of output when it was killed"
            details.append(hit("output", self.limits.output_mb, "MB", evidence, killed=True))
        elif killed_for == "timeout":
            evidence = "still running at the deadline"
            details.append(hit("timeout", timeout, "s", evidence, killed=True))
        return {
            "exit_code": None if killed_for else (128 + sig if sig else returncode),
            "signal": sig,
            "timed_out": killed_for == "timeout",
            "stdout": stdout,
            "stderr": stderr,
            "duration_ms": duration_ms,
            "limits_hit": [d["kind"] for d in details],
            "limit_details": details,
        }

    def _start(self, argv: list[str], env: dict[str, str], stdin: bool = False) -> Command:
        """``argv`` as the agent's user, in a new session, in /: through run-as when the
        image has a trusted one, else by subprocess (a fork of the agent). ``stdin``: its
        standard input a pipe the ``input`` request writes (else /dev/null)."""
        if self.run_as is not None:
            return spawn_as(self.run_as, self.uid, self.gid, argv, env, stdin)
        return subprocess.Popen(
            argv,
            cwd="/",
            env=env,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
            user=self.uid,
            group=self.gid,
            extra_groups=[],
        )

    def _wait(
        self,
        proc: Command,
        captures: dict[Any, Capture],
        deadline: float,
        streams: Any = None,
    ) -> tuple[str | None, str | None]:
        """Capture the command's output until it has exited and its streams are closed,
        it passed the deadline, or its output passed the output limit; then kill what is
        left of it. Returns (why it was killed: "timeout", "output" or None, evidence that
        the agent's user held its process limit just before the kill, or None).
        ``streams``: (stream names by pipe, budget, emit): each piece read is emitted too,
        while the stream's emitted bytes are within the budget."""
        sel = selectors.DefaultSelector()
        for stream in captures:
            assert stream is not None
            os.set_blocking(stream.fileno(), False)
            sel.register(stream, selectors.EVENT_READ)
        # A pidfd makes the command's exit an event like its output, so the loop wakes on it
        # instead of polling (old gVisor lacks pidfd_open: then poll every few ms, and
        # from 0.2 ms up once its streams have closed, which a command's exit does first:
        # a flat 5 ms cost gVisor's `true` 2.5 ms on average).
        pidfd = open_pidfd(proc.pid)
        nap = POLL_AFTER_CLOSE_S
        if pidfd is not None:
            sel.register(pidfd, selectors.EVENT_READ)
        exited_at: float | None = None
        output_limit = self.limits.output_bytes
        flooded = False
        try:
            while not flooded:
                now = time.monotonic()
                if exited_at is None and proc.poll() is not None:
                    exited_at = now
                    if pidfd is not None:
                        sel.unregister(pidfd)
                streams_open = len(sel.get_map()) > (
                    0 if exited_at is not None or pidfd is None else 1
                )
                if exited_at is not None and not streams_open:
                    break
                limit = (
                    deadline if exited_at is None else min(deadline, exited_at + DRAIN_AFTER_EXIT_S)
                )
                if now >= limit:
                    break
                if pidfd is not None:
                    wait = limit - now
                elif streams_open:
                    wait = min(limit - now, POLL_S)
                else:
                    wait = min(limit - now, nap)
                    nap = min(nap * 2, POLL_S)
                for key, _ in sel.select(timeout=wait):
                    if key.fileobj is pidfd:
                        continue
                    try:
                        data = os.read(key.fd, READ_CHUNK)
                    except BlockingIOError:
                        continue
                    except OSError as exc:  # a terminal whose last user closed it: its end
                        if exc.errno != errno.EIO:
                            raise
                        data = b""
                    if data:
                        capture = captures[key.fileobj]
                        if streams is not None and capture.total < streams[1]:
                            streams[2](streams[0][key.fileobj], data[: streams[1] - capture.total])
                        capture.feed(data)
                    else:
                        sel.unregister(key.fileobj)
                # A flood is drained, never buffered; past the output limit it is stopped,
                # rather than left to burn the CPU until the timeout.
                if output_limit and sum(c.total for c in captures.values()) > output_limit:
                    flooded = True
        finally:
            sel.close()
            if pidfd is not None:
                os.close(pidfd)
            running = proc.poll() is None
            # Under RLIMIT_NPROC (gVisor) a fork bomb shows only now, before it is killed;
            # counting processes costs a walk of /proc, so only when something went wrong.
            nproc_full = None
            if self.limits.limit_nproc:
                fork_failed = any(mentions([c.text()], FORK_FAILED_TEXT) for c in captures.values())
                if running or proc.returncode != 0 or fork_failed:
                    nproc_full = self.limits.processes_at_limit(fork_failed=fork_failed)
            if running:
                kill_tree(proc.pid)
            proc.wait()
            # Whatever the command left running in its process group goes too.
            kill_group(proc.pid)
            for stream in captures:
                stream.close()
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass  # a write racing it: the command is over either way
        if flooded:
            return "output", nproc_full
        return ("timeout" if running else None), nproc_full

    def signal(self, req: dict[str, object]) -> dict[str, object]:
        """Signal the running command started with ``exec_id``: ``kill`` its whole process
        group and descendants (its exec then answers as killed), or ``term`` the group.
        ``found`` is false when no such command runs (it ended, or never started)."""
        with self.running_lock:
            proc = self.running.get(str(req["exec_id"]))
        if proc is None or proc.poll() is not None:
            return {"found": False}
        if req.get("signal") == "term":
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except OSError:
                return {"found": False}
        else:
            kill_tree(proc.pid)
        return {"found": True}

    def input(self, req: dict[str, object]) -> dict[str, object]:
        """Write ``data`` (base64) to the standard input of the command named ``exec_id``
        (started with ``stdin``), then, with ``close``, close it (its EOF). ``found``:
        False when no command of that name runs; ``error`` when it has no such input."""
        with self.running_lock:
            proc = self.running.get(str(req["exec_id"]))
        if proc is None:
            return {"found": False}
        size = req.get("resize")
        if isinstance(size, list) and len(size) == 2:
            if not getattr(proc, "terminal", False) or proc.stdin is None:
                return {"found": True, "error": "the command has no terminal to resize"}
            try:  # through its input, the master's copy: closed (ValueError) once it ended
                set_terminal_size(proc.stdin.fileno(), int(size[0]), int(size[1]))
            except (OSError, ValueError) as exc:
                return {"found": True, "error": f"its terminal is closed: {exc}"}
            return {"found": True}
        if proc.stdin is None:
            return {"found": True, "error": "the command was not started with stdin"}
        try:
            data = req.get("data")
            if data:
                proc.stdin.write(base64.b64decode(str(data)))
            if req.get("close"):
                proc.stdin.close()
        except (OSError, ValueError) as exc:  # it ended, or closed its input: as a pipe says
            return {"found": True, "error": f"its input is closed: {exc}"}
        return {"found": True}

    def read_file(self, req: dict[str, object]) -> dict[str, object]:
        """Read in a forked child that has become the unprivileged user, so read_file can
        see exactly what the agent's own shell could, and nothing more."""
        return self._as_user(req, read_lines)

    def files(self, req: dict[str, object]) -> dict[str, object]:
        """A filesystem operation (:func:`file_op`) as the unprivileged user, anywhere it
        may go: what an E2B client's ``files`` API does."""
        return self._as_user(req, lambda r: file_op(r, self.home))

    def _as_user(self, req: dict[str, object], work: Any) -> dict[str, object]:
        """``work(req)`` in a forked child that has become the unprivileged user."""
        rfd, wfd = os.pipe()
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(rfd)
            os.close(wfd)
            spawn = self.limits.spawn_failure(exc)
            if "limits_hit" not in spawn:
                raise
            detail = spawn["limit_details"][0]  # type: ignore[index]
            message = (
                f"cannot read {req.get('path')}: the sandbox's limit of {detail['limit']} "
                "processes is full of processes the agent's commands left running"
            )
            return file_error("pids_limit", message)
        if pid == 0:  # child
            code = 0
            try:
                os.close(rfd)
                os.setgroups([])
                os.setgid(self.gid)
                os.setuid(self.uid)
                reply = work(req)
            except BaseException as exc:  # noqa: BLE001 - the child must always answer
                reply = file_error(protocol.INTERNAL, repr(exc))
                code = 1
            data = json.dumps(reply).encode()
            view = memoryview(data)
            while view:
                view = view[os.write(wfd, view) :]
            os._exit(code)
        os.close(wfd)
        chunks = []
        with os.fdopen(rfd, "rb") as pipe:
            while True:
                chunk = pipe.read(READ_CHUNK)
                if not chunk:
                    break
                chunks.append(chunk)
        os.waitpid(pid, 0)
        return json.loads(b"".join(chunks))  # type: ignore[no-any-return]


file_error = protocol.file_error


ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def checked_env(extra: object) -> dict[str, str]:
    """A command's own environment variables: names a shell can hold, no NUL anywhere."""
    if not isinstance(extra, dict):
        raise ValueError("env must be an object of strings")
    for name, value in extra.items():
        if not (isinstance(name, str) and ENV_NAME.match(name)):
            raise ValueError(f"env: {name!r} is not a variable name")
        if not isinstance(value, str) or "\0" in value:
            raise ValueError(f"env: {name} must be a string without NUL")
    return dict(extra)


def entry_info(path: str) -> dict[str, object]:
    """What ``stat`` says of ``path`` (not following a final symlink), for the client."""
    st = os.lstat(path)
    is_link = stat.S_ISLNK(st.st_mode)
    if is_link:
        try:
            target_st = os.stat(path)
            kind = "dir" if stat.S_ISDIR(target_st.st_mode) else "file"
        except OSError:
            kind = "file"
    else:
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    # datetime.UTC is 3.11's: the agent runs on the image's python3, 3.9 and later.
    modified = datetime.fromtimestamp(st.st_mtime, tz=timezone.utc)  # noqa: UP017
    info: dict[str, object] = {
        "name": os.path.basename(path.rstrip("/")) or "/",
        "type": kind,
        "path": path,
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "permissions": stat.filemode(st.st_mode),
        "owner": owner,
        "group": group,
        "modified": modified.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "symlink": is_link,
    }
    if is_link:
        info["symlink_target"] = os.readlink(path)
    return info


def file_op(req: dict[str, object], home: str) -> dict[str, object]:
    """One filesystem operation: ``stat``, ``list`` (to ``depth``), ``mkdir`` (with its
    parents; ``created`` false when it was a directory already), ``remove`` (whatever is
    there, recursively; nothing there is fine), ``move``, ``read`` (at most ``max_bytes``,
    base64) or ``write`` (base64; parents made, the file replaced). Relative paths are
    under /workspace, ``~`` is the home. Errors: not_found, is_directory, not_directory,
    exists, permission, too_large, invalid."""
    action = str(req["action"])

    def resolve(raw: object) -> str:
        text = str(raw)
        if "\0" in text or not text:
            raise ValueError("a path is a non-empty string without NUL")
        if text == "~" or text.startswith("~/"):
            text = home + text[1:]
        return os.path.normpath(os.path.join(WORKSPACE, text))

    path = resolve(req["path"])
    try:
        if action == "stat":
            return {"entry": entry_info(path)}
        if action == "list":
            if not os.path.isdir(path):
                if os.path.lexists(path):
                    return file_error("not_directory", f"{path} is not a directory")
                return file_error("not_found", f"{path} does not exist")
            depth = max(1, int(req.get("depth") or 1))  # type: ignore[call-overload]
            entries = []
            level = [path]
            for _ in range(depth):
                below = []
                for directory in level:
                    for name in sorted(os.listdir(directory)):
                        full = os.path.join(directory, name)
                        entries.append(entry_info(full))
                        if os.path.isdir(full) and not os.path.islink(full):
                            below.append(full)
                level = below
            return {"entries": entries}
        if action == "mkdir":
            if os.path.isdir(path):
                return {"created": False, "entry": entry_info(path)}
            if os.path.lexists(path):
                return file_error("exists", f"{path} exists and is not a directory")
            os.makedirs(path)
            return {"created": True, "entry": entry_info(path)}
        if action == "remove":
            if os.path.isdir(path) and not os.path.islink(path):
                import shutil

                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.unlink(path)
            return {}
        if action == "move":
            target = resolve(req["target"])
            os.makedirs(os.path.dirname(target) or "/", exist_ok=True)
            os.replace(path, target)
            return {"entry": entry_info(target)}
        if action == "read":
            max_bytes = int(req["max_bytes"])  # type: ignore[call-overload]
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
            with os.fdopen(fd, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                if stat.S_ISDIR(mode):
                    return file_error("is_directory", f"{path} is a directory")
                if not stat.S_ISREG(mode):
                    return file_error("invalid", f"{path} is not a regular file")
                os.set_blocking(f.fileno(), True)
                data = f.read(max_bytes + 1)
            if len(data) > max_bytes:
                return file_error("too_large", f"{path} is larger than {max_bytes} bytes")
            return {"data": base64.b64encode(data).decode(), "size": len(data)}
        if action == "write":
            data = base64.b64decode(str(req["data"]), validate=True)
            if os.path.isdir(path):
                return file_error("is_directory", f"{path} is a directory")
            os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
            with open(path, "wb") as out:
                out.write(data)
            return {"entry": entry_info(path)}
    except FileNotFoundError as exc:
        return file_error("not_found", f"{exc.filename or path} does not exist")
    except IsADirectoryError:
        return file_error("is_directory", f"{path} is a directory")
    except NotADirectoryError:
        return file_error("not_directory", f"a parent of {path} is not a directory")
    except FileExistsError:
        return file_error("exists", f"{path} exists")
    except PermissionError:
        return file_error("permission", f"{path}: permission denied")
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            return file_error("no_space", f"{path}: no space left on device")
        return file_error("invalid", f"{path}: {exc.strerror}")
    raise ValueError(f"unknown files action {action!r}")


def read_lines(req: dict[str, object]) -> dict[str, object]:
    raw_path = str(req["path"])
    start = int(req.get("start_line") or 1)  # type: ignore[call-overload]
    end_value = req.get("end_line")
    end = int(end_value) if end_value is not None else None  # type: ignore[call-overload]
    max_bytes = int(req["max_bytes"])  # type: ignore[call-overload]
    scan_limit = int(req.get("scan_limit") or 64 << 20)  # type: ignore[call-overload]
    workspace = os.path.realpath(WORKSPACE)
    path = raw_path
    if path.startswith(WORKSPACE + "/") or path == WORKSPACE:
        path = path[len(WORKSPACE) :].lstrip("/") or "."
    if os.path.isabs(path):
        return file_error("outside_workspace", f"{raw_path} is outside /workspace")
    full = os.path.realpath(os.path.join(workspace, path))
    if full != workspace and not full.startswith(workspace + "/"):
        return file_error("outside_workspace", f"{raw_path} resolves outside /workspace")
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; anything but a regular
        # file is refused below, before a single byte is read.
        fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        return file_error("not_found", f"{raw_path}: no such file")
    except IsADirectoryError:
        return file_error("is_directory", f"{raw_path} is a directory")
    except PermissionError:
        return file_error("permission", f"{raw_path}: permission denied")
    except OSError as exc:
        return file_error("invalid", f"{raw_path}: {exc.strerror}")
    mode = os.fstat(fd).st_mode
    if stat.S_ISDIR(mode):
        os.close(fd)
        return file_error("is_directory", f"{raw_path} is a directory")
    if not stat.S_ISREG(mode):
        os.close(fd)
        return file_error("invalid", f"{raw_path} is not a regular file")
    os.set_blocking(fd, True)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        sniff = f.read(8192)
        if b"\0" in sniff:
            return file_error("binary", f"{raw_path} is a binary file ({size} bytes)")
        f.seek(0)
        out = bytearray()
        line_no = 0
        last = start - 1
        truncated = False
        scanned = 0
        complete = True
        for line in f:
            line_no += 1
            scanned += len(line)
            if line_no >= start and (end is None or line_no <= end) and not truncated:
                if len(out) + len(line) > max_bytes:
                    truncated = True
                else:
                    out += line
                    last = line_no
            if (truncated or (end is not None and line_no >= end)) and scanned > scan_limit:
                complete = False
                break
    return {
        "path": raw_path,
        "text": bytes(out).decode("utf-8", "replace"),
        "start_line": start,
        "end_line": last,
        "total_lines": line_no if complete else None,
        "truncated": truncated,
        "size_bytes": size,
    }


# Kernel filesystems hold no state a command leaves (a process's /proc entries go with it;
# /sys and the cgroup tree are read-only or root's); /dev/pts changes with every terminal;
# /workspace is checked by the host, on its upper layer; the agent's socket directory is
# the host's.
MANIFEST_SKIP_FSTYPES = {"proc", "sysfs", "cgroup", "cgroup2", "devpts"}
MANIFEST_SKIP_MOUNTS = {WORKSPACE, "/run/orchestrator"}
MANIFEST_MAX_ENTRIES = 20_000
SYSV_IPC = ("shm", "sem", "msg")


def sandbox_manifest() -> dict[str, object]:
    """The sandbox's processes (uid and name: pids differ between two fresh sandboxes),
    its mounts (point, type, rw or ro), the tree of every writable filesystem but the
    kernel's (path, type, mode, owner, size, link target) and its System V IPC objects."""
    processes = [[uid, name] for _, uid, name in process_table()]
    mounts = mount_table()
    trees: dict[str, object] = {point: tree_of(point) for point in writable_trees(mounts)}
    ipc = {}
    for kind in SYSV_IPC:
        try:
            with open(f"/proc/sysvipc/{kind}") as table:
                ipc[kind] = len(table.readlines()) - 1  # the header
        except OSError:
            ipc[kind] = -1
    return {"processes": sorted(processes), "mounts": sorted(mounts), "trees": trees, "ipc": ipc}


def mount_table() -> list[list[str]]:
    """This sandbox's mounts: point, type, and ``rw`` or ``ro``."""
    mounts = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            point = fields[4].replace("\\040", " ")
            fstype = fields[fields.index("-") + 1]
            writable = fields[5].split(",")[0] == "rw"
            mounts.append([point, fstype, "rw" if writable else "ro"])
    return mounts


def writable_trees(mounts: list[list[str]]) -> list[str]:
    """The mount points whose trees can hold what a command leaves (see the skips)."""
    return sorted(
        {
            point
            for point, fstype, mode in mounts
            if mode == "rw"
            and fstype not in MANIFEST_SKIP_FSTYPES
            and point not in MANIFEST_SKIP_MOUNTS
        }
    )


KERNEL_TREES = ("/dev", "/sys", "/proc", "/run")


def user_trees() -> list[str]:
    """The writable trees that hold the user's files (/tmp, its home, scratch
    directories): not the kernel's or the runtime's (/dev/shm is memory, /sys/fs/cgroup a
    tmpfs on cgroup v1)."""
    return [
        point
        for point in writable_trees(mount_table())
        if not any(point == top or point.startswith(top + "/") for top in KERNEL_TREES)
    ]


def process_table() -> list[tuple[int, int, str]]:
    """Every process of the sandbox: pid, real uid, name (zombies included: not yet
    reaped)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as status:
                known = dict(line.split(":", 1) for line in status if ":" in line)
        except OSError:
            continue  # it exited meanwhile
        found.append((int(entry), int(known["Uid"].split()[0]), known["Name"].strip()))
    return found


def processes_of(uid: int) -> list[list[object]]:
    """The pids and names of ``uid``'s processes."""
    return [[pid, name] for pid, owner, name in process_table() if owner == uid]


def end_processes_of(uid: int, timeout_s: float) -> list[list[object]]:
    """SIGKILL every process of ``uid`` until none is left, or ``timeout_s`` passed (then
    those still there). A process forked meanwhile is found by the next pass; the killed
    are reaped by the sandbox's init or by their parent, which is killed too."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while True:
        found = processes_of(uid)
        if not found or time.monotonic() > deadline:
            return found
        for pid, _ in found:
            try:
                os.kill(int(pid), signal.SIGKILL)  # type: ignore[call-overload]
            except OSError:
                pass  # gone already
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def stage_files(req: dict[str, object]) -> dict[str, object]:
    """The file half of :meth:`Agent.stage`, run as the agent's user."""
    purge = {str(name) for name in req.get("purge") or []}  # type: ignore[attr-defined]
    suffixes = tuple(name[1:] for name in purge if name.startswith("*."))
    keep = {str(path) for path in req.get("keep") or []}  # type: ignore[attr-defined]
    removed: list[str] = []
    pending = [WORKSPACE]
    while pending:
        top = pending.pop()
        # A directory the agent made unlistable (mode 0311) still lets a test runner find a
        # conftest.py by its name: every directory is opened up before it is listed.
        try:
            os.chmod(top, stat.S_IMODE(os.lstat(top).st_mode) | stat.S_IRWXU)
        except PermissionError:
            pass  # not the agent's: what it could not change, it did not tamper with
        with os.scandir(top) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    if not (top == WORKSPACE and entry.name == ".git"):
                        pending.append(entry.path)
                    continue
                relative = os.path.relpath(entry.path, WORKSPACE)
                named = entry.name in purge or (bool(suffixes) and entry.name.endswith(suffixes))
                if named and relative not in keep:
                    os.unlink(entry.path)
                    removed.append(relative)
    for relative in req.get("remove") or []:  # type: ignore[attr-defined]
        removed += [str(relative)] if remove_path(workspace_path(str(relative))) else []
    written = 0
    try:
        for relative, encoded in dict(req.get("write") or {}).items():  # type: ignore[call-overload]
            path = workspace_path(str(relative))
            remove_path(path)
            directory = os.path.dirname(path)
            make_directories(directory)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as out:
                out.write(base64.b64decode(str(encoded)))
            written += 1
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return {"removed": removed, "written": written, "no_space": True}
        raise
    return {"removed": removed, "written": written, "no_space": False}


PACKED_TYPES = (b"0", b"1", b"2", b"5", b"6")
"""Tar member types a pack holds and an unpack restores: regular files, hard and symbolic
links, directories, FIFOs (never devices: the user cannot make them)."""


def pack_trees(points: list[str], fd: int) -> dict[str, object]:
    """The half of :meth:`Agent.pack` run as the user: every entry under ``points`` (not
    the points themselves: their owners and modes are the sandbox's) written to ``fd``."""
    import tarfile

    members = 0
    skipped: list[str] = []
    with os.fdopen(os.dup(fd), "wb") as out:
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for point in points:
                for top, dirs, files in os.walk(point):
                    # Symbolic links to directories are listed in dirs and added as links.
                    for name in sorted(dirs) + sorted(files):
                        path = os.path.join(top, name)
                        try:
                            tar.add(path, arcname=path.lstrip("/"), recursive=False)
                            members += 1
                        except OSError:
                            skipped.append(path)
        out.flush()
        size = out.tell()
    return {"members": members, "bytes": size, "skipped": skipped[:100]}


def unpack_trees(points: list[str], fd: int) -> dict[str, object]:
    """The half of :meth:`Agent.unpack` run as the user: members under ``points`` only, of
    the types a pack makes; anything else is skipped and named."""
    import tarfile

    restored = 0
    skipped: list[str] = []
    directories: list[tarfile.TarInfo] = []

    def inside(name: str) -> bool:
        path = "/" + os.path.normpath(name).lstrip("/")
        return ".." not in path.split("/") and any(path.startswith(p + "/") for p in points)

    # (the checks above are the filter: extraction runs as the user, in the user's trees)
    trusted = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
    with os.fdopen(os.dup(fd), "rb") as source, tarfile.open(fileobj=source, mode="r|") as tar:
        for member in tar:
            ok = inside(member.name) and member.type in PACKED_TYPES
            if ok and member.islnk():
                ok = inside(member.linkname)
            if not ok:
                skipped.append(member.name)
                continue
            try:
                # A directory's mode after its contents (one the user made read-only
                # would refuse them).
                tar.extract(member, "/", set_attrs=not member.isdir(), **trusted)  # type: ignore[arg-type]
                restored += 1
            except OSError:
                skipped.append(member.name)
                continue
            if member.isdir():
                directories.append(member)
    for member in reversed(directories):
        path = "/" + member.name.lstrip("/")
        try:
            os.chmod(path, member.mode)
            os.utime(path, (member.mtime, member.mtime))
        except OSError:
            skipped.append(member.name)
    return {"restored": restored, "skipped": skipped[:100]}


def workspace_path(relative: str) -> str:
    """``relative`` under /workspace; ValueError for one that leaves it."""
    path = os.path.normpath(os.path.join(WORKSPACE, relative))
    if not path.startswith(WORKSPACE + "/"):
        raise ValueError(f"{relative!r} is not under {WORKSPACE}")
    return path


def remove_path(path: str) -> bool:
    """Remove a file, a link or a whole tree at ``path``; False when nothing was there."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)
    return True


def make_directories(directory: str) -> None:
    """Every directory from /workspace down to ``directory``, replacing whatever of the
    agent's stands in the way (a file, or a link that would lead the write elsewhere)."""
    current = WORKSPACE
    for part in os.path.relpath(directory, WORKSPACE).split(os.sep):
        if part in ("", "."):
            continue
        current = os.path.join(current, part)
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            os.mkdir(current, 0o755)
            continue
        if not stat.S_ISDIR(info.st_mode):
            os.unlink(current)
            os.mkdir(current, 0o755)


IPC_RMID = 0


def remove_sysv_ipc() -> int:
    """Remove every System V IPC object this process may (its owner's: the sandbox has an
    IPC namespace of its own, so all of them are the sandbox's). Returns how many went."""
    libc = ctypes.CDLL(None, use_errno=True)
    removers = {
        "shm": lambda ident: libc.shmctl(ident, IPC_RMID, None),
        "sem": lambda ident: libc.semctl(ident, 0, IPC_RMID),
        "msg": lambda ident: libc.msgctl(ident, IPC_RMID, None),
    }
    removed = 0
    for kind in SYSV_IPC:
        try:
            with open(f"/proc/sysvipc/{kind}") as table:
                rows = table.readlines()[1:]  # the header
        except OSError:
            continue
        for row in rows:
            if removers[kind](int(row.split()[1])) == 0:
                removed += 1
    return removed


def empty_tree(root: str) -> list[str]:
    """Remove every entry under ``root`` (on its own filesystem) that this process can:
    directories of its own are opened up first (a mode of 000 must not keep their
    contents); what belongs to another user stays. Returns what could not go."""
    device = os.lstat(root).st_dev
    kept: list[str] = []
    uid = os.getuid()

    def empty(directory: str) -> None:
        try:
            names = os.listdir(directory)
        except OSError as exc:
            kept.append(f"{directory}: {exc.strerror}")
            return
        for name in names:
            path = os.path.join(directory, name)
            try:
                info = os.lstat(path)
                if stat.S_ISDIR(info.st_mode) and info.st_dev == device:
                    if info.st_uid == uid:
                        os.chmod(path, 0o700)
                    empty(path)
                    os.rmdir(path)
                else:
                    os.unlink(path)
            except OSError as exc:
                kept.append(f"{path}: {exc.strerror}")

    empty(root)
    return kept


def tree_of(root: str) -> list[list[object]]:
    """Every entry under ``root`` on its own filesystem (mounts below it are listed apart),
    sorted; a tree past :data:`MANIFEST_MAX_ENTRIES` ends with a truncation marker."""
    device = os.lstat(root).st_dev
    entries: list[list[object]] = []
    stack = [root]
    while stack and len(entries) < MANIFEST_MAX_ENTRIES:
        path = stack.pop()
        info = os.lstat(path)
        relative = os.path.relpath(path, root)
        kind = stat.S_IFMT(info.st_mode)
        entry: list[object] = [relative, kind, stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid]
        if stat.S_ISREG(kind):
            entry.append(info.st_size)
        elif stat.S_ISLNK(kind):
            entry.append(os.readlink(path))
        entries.append(entry)
        if stat.S_ISDIR(kind) and info.st_dev == device:
            try:
                stack += [os.path.join(path, name) for name in os.listdir(path)]
            except OSError as exc:
                entries.append([relative, "unreadable", str(exc)])
    if stack:
        entries.append(["...", "truncated", len(stack)])
    return sorted(entries, key=lambda e: str(e[0]))


class Handler(socketserver.StreamRequestHandler):
    server: Server

    def handle(self) -> None:
        line = self.rfile.readline(MAX_REQUEST_BYTES)
        if not line.strip():
            return  # a port check (the kubelet's readiness probe), not a request
        try:
            req = json.loads(line)
            if not authorized(req, self.client_address):
                self.wfile.write(protocol.refused(protocol.Refusal.UNAUTHORIZED, "bad token"))
                return
            op = req["op"]
            if op == protocol.Op.EXEC and req.get("stream"):
                # The command's output as it is printed, a line per piece, before the reply.
                reply = protocol.ok(agent.exec(req, emit=self._emit))
            else:
                reply = protocol.ok(methods[op](req))
        except Exception as exc:  # noqa: BLE001 - every failure must reach the caller
            reply = protocol.refused(protocol.Refusal.FAILED, f"{type(exc).__name__}: {exc}")
        self.wfile.write(reply)

    def _emit(self, stream: str, data: bytes) -> None:
        self.wfile.write(protocol.chunk(stream, data))
        self.wfile.flush()


def answers(agent: Agent) -> dict[str, Any]:
    """What answers each request, by its op (made once, at the start)."""
    op = protocol.Op
    return {
        op.PING: agent.ping,
        op.EXEC: agent.exec,
        op.READ_FILE: agent.read_file,
        op.SIGNAL: agent.signal,
        op.FILES: agent.files,
        op.MANIFEST: agent.manifest,
        op.SCRUB: agent.scrub,
        op.STAGE: agent.stage,
        op.PACK: agent.pack,
        op.INPUT: agent.input,
        op.UNPACK: agent.unpack,
    }


TOKEN: bytes | None = None
"""The sandbox's token, when requests must carry it (TCP mode); None over a Unix socket,
whose directory only the host can reach."""


def authorized(req: object, client_address: object) -> bool:
    """Whether a request carries the sandbox's token (always, when none is required)."""
    if TOKEN is None:
        return True
    given = req.get("token") if isinstance(req, dict) else None
    import hmac

    if isinstance(given, str) and hmac.compare_digest(given.encode(), TOKEN):
        return True
    log(f"refused a request from {client_address}: {'wrong' if given else 'missing'} token")
    return False


class ServerMixin:
    request_queue_size = 256


class Server(ServerMixin, socketserver.UnixStreamServer):
    """The agent over a Unix socket (Docker: a host directory mounted into one sandbox)."""


class TcpServer(ServerMixin, socketserver.TCPServer):
    """The agent over TCP (Kubernetes: the pod network, every request carrying the token)."""

    allow_reuse_address = True


# Threads kept waiting in accept() between requests. Each accepts a connection and answers
# it itself (leader/follower): socketserver's thread per connection cost 0.45 ms a request
# in a runc sandbox and 1.2 ms under gVisor, a thread start before the request was read;
# from accept() to the request's handler is now 0.10 ms (runc; the agent timed inside with
# perf_counter marks, p50 of 200 `true` execs). Two wait, so a request that comes
# while one answers (a "signal" during an exec) finds the other: the agent holds as many
# tasks while a command runs as it did (its main thread and one answering), one more at
# rest, none of the agent's user's.
IDLE_ACCEPTORS = 2
# How long an accept() waits before its thread looks around: SIGTERM's handler runs in the
# main thread only, and within this (serve_forever's poll interval was the same).
ACCEPT_POLL_S = 0.5


class Acceptors:
    """The threads that accept and answer the agent's connections."""

    def __init__(self, server: socketserver.BaseServer) -> None:
        self.server = server
        self.socket: Any = server.socket  # type: ignore[attr-defined]
        self.socket.settimeout(ACCEPT_POLL_S)
        self.lock = threading.Lock()
        self.idle = 0

    def serve_forever(self) -> None:
        """Accept and answer in this (the main) thread, which never leaves, and in others."""
        self.spawn()
        self.accept_loop(main=True)

    def spawn(self) -> bool:
        try:
            threading.Thread(target=self.accept_loop, daemon=True).start()
            return True
        except RuntimeError:
            # No thread to be had: the pids limit counts threads, and the agent's user may
            # fill it. The thread that found this answers its request anyway, so the host
            # hears why (a reply that says pids_limit), then accepts again.
            return False

    def accept_loop(self, main: bool = False) -> None:
        while True:
            with self.lock:
                if not main and self.idle >= IDLE_ACCEPTORS:
                    return  # enough wait without this one (it was spawned for a busy moment)
                self.idle += 1
            try:
                request, address = self.socket.accept()
            except OSError as exc:
                # A timeout (3.9's socket.timeout is no TimeoutError) has no errno; EMFILE
                # and the like do: try again, without spinning.
                if exc.errno is not None:
                    time.sleep(0.01)
                continue
            finally:
                with self.lock:
                    self.idle -= 1
                    alone = self.idle == 0
            if alone:
                self.spawn()  # someone must accept while this thread answers
            self.answer(request, address)

    def answer(self, request: Any, address: Any) -> None:
        """What socketserver's process_request_thread does with one connection."""
        request.settimeout(None)
        try:
            self.server.finish_request(request, address)
        except Exception:  # noqa: BLE001 - one broken connection must not end the thread
            self.server.handle_error(request, address)
        finally:
            self.server.shutdown_request(request)


def listen(address: str) -> socketserver.BaseServer:
    """A server on ``unix:PATH`` or ``tcp:HOST:PORT``."""
    kind, _, where = address.partition(":")
    if kind == "unix" and where:
        try:
            os.unlink(where)
        except FileNotFoundError:
            pass
        os.umask(0o077)
        return Server(where, Handler)
    if kind == "tcp":
        host, _, port = where.rpartition(":")
        if host and port.isdigit():
            return TcpServer((host.strip("[]"), int(port)), Handler)
    raise SystemExit(f"exec-agent: --listen wants unix:PATH or tcp:HOST:PORT, not {address!r}")


def log(message: str) -> None:
    sys.stderr.write(f"exec-agent: {message}\n")
    sys.stderr.flush()


agent: Agent
methods: dict[str, Any]


def main() -> None:
    global agent, methods, TOKEN
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", default=None, help="Unix socket (same as --listen unix:)")
    parser.add_argument("--listen", default=None, help="unix:PATH or tcp:HOST:PORT")
    parser.add_argument(
        "--token-file", default=None, help="Requests must carry this file's token (TCP: required)"
    )
    parser.add_argument("--uid", type=int, default=1000)
    parser.add_argument("--gid", type=int, default=1000)
    parser.add_argument("--home", default="/home/agent")
    parser.add_argument("--preload", default=None, help="LD_PRELOAD for commands")
    parser.add_argument(
        "--run-as",
        default=RUN_AS,
        help="The setuid helper to start commands through, when trusted ('' for none)",
    )
    parser.add_argument("--limit-as-mb", type=int, default=None, help="RLIMIT_AS per command")
    parser.add_argument("--limit-nproc", type=int, default=None, help="RLIMIT_NPROC per command")
    parser.add_argument(
        "--limits",
        type=json.loads,
        default={},
        help="The sandbox's limits as JSON (memory_mb, pids, output_mb, disk: {path: mb}), "
        "to tell when a command hits one",
    )
    args = parser.parse_args()
    address = args.listen or (f"unix:{args.socket}" if args.socket else None)
    if address is None:
        parser.error("one of --socket or --listen is required")
    if args.token_file:
        with open(args.token_file, "rb") as f:
            TOKEN = f.read().strip()
        if not TOKEN:
            parser.error(f"{args.token_file} holds no token")
    elif address.startswith("tcp:"):
        parser.error("--listen tcp: requires --token-file")
    uid, gid = args.uid, args.gid
    if os.getuid() == uid:
        # Commands as the agent's own user could kill or stop it: whatever the agent did to
        # its sandbox would then end it as if we had, and it would be discarded, not scored.
        parser.error(f"the agent must not run as uid {uid}, the uid its commands run as")
    run_as = trusted_run_as(args.run_as)
    if args.run_as and run_as is None and os.path.lexists(args.run_as):
        log(f"not using {args.run_as}: it or a directory above it is not root's alone")
    if run_as is not None:
        try:
            keep_inheritable()
        except OSError as exc:
            log(f"not using {run_as}: {exc}")
            run_as = None
    drop_bounding_set()
    wrapper = shell_wrapper(args.limit_as_mb, args.limit_nproc)
    limits = Limits(args.limits, uid, args.limit_as_mb, args.limit_nproc)
    agent = Agent(uid, gid, args.home, args.preload, wrapper, limits, run_as)
    methods = answers(agent)
    server = listen(address)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    how = f"through {run_as}" if run_as else "by fork"
    log(f"listening on {address} (pid {os.getpid()}), running commands as uid {uid} {how}")
    Acceptors(server).serve_forever()


if __name__ == "__main__":
    main()
