"""Commands as processes: started as the sandbox's user through run-as (a vfork) or a fork
of the agent, on pipes or a terminal, the agent's own capabilities dropped first; their
output kept head and tail; their process trees found and ended. Part of the exec agent
(exec_agent.py): standard library only, Python 3.9+, put beside it in every sandbox."""

from __future__ import annotations

import collections
import ctypes
import errno
import os
import signal
import stat
import sys
import threading
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

PR_CAPBSET_DROP = 24
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


def log(message: str) -> None:
    sys.stderr.write(f"exec-agent: {message}\n")
    sys.stderr.flush()
