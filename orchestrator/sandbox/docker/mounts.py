"""The host's mount(2) and umount2(2), called directly: a sandbox's /workspace is mounted
and unmounted on the host at every create, reset and destroy, and a `mount` or `umount`
child costs a fork and an exec (about 3 ms of CPU each) for a system call of microseconds.

Only what workspace.py needs: an overlay, a directory bound onto itself as a shared mount
(the point whose later mounts propagate into a running container: workspace.py), and a
count of what is mounted at a path (``os.path.ismount`` cannot see a directory bound onto
itself: same device as its parent).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from functools import lru_cache
from pathlib import Path

MS_BIND = 4096
MS_SHARED = 1 << 20
MNT_DETACH = 2


class MountError(OSError):
    """A mount or an unmount the kernel refused (``errno`` says why: EBUSY, ...)."""


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(result: int, action: str, path: Path) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise MountError(code, f"cannot {action} {path}: {os.strerror(code)}")


def mount(source: str, target: Path, fstype: str | None, flags: int, data: str = "") -> None:
    """mount(2); raises :class:`MountError`."""
    result = _libc().mount(
        source.encode(),
        str(target).encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    _check(result, f"mount {fstype or 'a bind'} at", target)


MS_RDONLY = 1


def overlay_options(lowers: list[Path], upper: Path | None, work: Path | None) -> str:
    """An overlay's options: ``lowers`` read-only, top first; without ``upper`` the whole
    overlay is read-only (two lower layers at least)."""
    options = "lowerdir=" + ":".join(str(lower) for lower in lowers)
    if upper is not None and work is not None:
        options += f",upperdir={upper},workdir={work}"
    return options


def mount_overlay(target: Path, lowers: list[Path], upper: Path | None, work: Path | None) -> None:
    """An overlay of ``lowers`` (read-only, top first) and ``upper`` at ``target``; with no
    ``upper``, read-only."""
    flags = MS_RDONLY if upper is None else 0
    mount("overlay", target, "overlay", flags, overlay_options(lowers, upper, work))


def bind_shared(path: Path) -> None:
    """Bind ``path`` onto itself and make that mount shared: what is mounted on ``path``
    later propagates to the binds of it made since (a container's, made ``rslave``)."""
    mount(str(path), path, None, MS_BIND)
    mount("none", path, None, MS_SHARED)


def unmount(path: Path, *, detach_if_busy: bool = True) -> bool:
    """Unmount the topmost mount at ``path``. A busy one is detached lazily (the kernel
    finishes once its last user is gone, and a loop device frees itself then) when
    ``detach_if_busy``; otherwise EBUSY raises. Nothing mounted there is no error (False:
    there was none)."""
    libc = _libc()
    if libc.umount2(str(path).encode(), 0) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOENT):  # not a mount point, or no such path
        return False
    if code == errno.EBUSY and detach_if_busy:
        _check(libc.umount2(str(path).encode(), MNT_DETACH), "detach", path)
        return True
    raise MountError(code, f"cannot unmount {path}: {os.strerror(code)}")


MOUNTS_STACKED_MAX = 16
"""More mounts than this stacked on one of our paths is a bug, not something to undo."""


def unmount_all(path: Path) -> None:
    """Unmount everything mounted at ``path``, topmost first (busy ones detached), without
    reading the mount table (its text grows with every sandbox's mounts: read per reset,
    it was the worker's costliest step in a burst)."""
    for _ in range(MOUNTS_STACKED_MAX):
        if not unmount(path):
            return


def covered(path: Path) -> bool:
    """Whether a filesystem other than its parent directory's is mounted on ``path`` (a
    bind of a directory onto itself is not: it shows its own filesystem)."""
    return path.stat().st_dev != path.parent.stat().st_dev


def mounted_at(path: Path) -> int:
    """How many mounts this process's namespace has at exactly ``path``."""
    wanted = os.fsencode(str(path))
    count = 0
    with Path("/proc/self/mountinfo").open("rb") as mountinfo:
        for line in mountinfo:
            point = line.split(b" ", 5)[4]
            if _unescape(point) == wanted:
                count += 1
    return count


def _unescape(field: bytes) -> bytes:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    if b"\\" not in field:
        return field
    out = bytearray()
    i = 0
    while i < len(field):
        if field[i : i + 1] == b"\\" and field[i + 1 : i + 4].isdigit():
            out.append(int(field[i + 1 : i + 4], 8))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return bytes(out)
