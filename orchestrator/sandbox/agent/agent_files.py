"""The sandbox's filesystem as the host asks for it: file operations and line reads under
/workspace as the agent's user; everywhere state can outlive a rollout (the manifest a
reset is audited by); files staged for a grader, writable trees packed and unpacked (a
snapshot), trees emptied (a reset). Part of the exec agent (exec_agent.py): standard
library only, Python 3.9+, put beside it in every sandbox."""

from __future__ import annotations

import base64
import ctypes
import errno
import grp
import os
import pwd
import shutil
import stat
from datetime import datetime, timezone

TYPE_CHECKING = False
if TYPE_CHECKING:
    from orchestrator.sandbox.agent import agent_protocol as protocol
    from orchestrator.sandbox.agent.agent_processes import process_table
else:
    try:  # in a sandbox: the files beside this one (their directory is first on sys.path)
        import agent_protocol as protocol
        from agent_processes import process_table
    except ImportError:  # imported on the host (run-as's constants, tests)
        from orchestrator.sandbox.agent import agent_protocol as protocol
        from orchestrator.sandbox.agent.agent_processes import process_table

WORKSPACE = "/workspace"


file_error = protocol.file_error


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
    except OSError as exc:
        return path_error(exc, path, missing=f"{exc.filename or path} does not exist")
    raise ValueError(f"unknown files action {action!r}")


def path_error(exc: OSError, path: str, *, missing: str) -> dict[str, object]:
    """An OSError on ``path`` as the file error the caller hears (the path's problem, never
    ours); ``missing``: how a path that does not exist is said."""
    if isinstance(exc, FileNotFoundError):
        return file_error("not_found", missing)
    if isinstance(exc, IsADirectoryError):
        return file_error("is_directory", f"{path} is a directory")
    if isinstance(exc, NotADirectoryError):
        return file_error("not_directory", f"a parent of {path} is not a directory")
    if isinstance(exc, FileExistsError):
        return file_error("exists", f"{path} exists")
    if isinstance(exc, PermissionError):
        return file_error("permission", f"{path}: permission denied")
    if exc.errno == errno.ENOSPC:
        return file_error("no_space", f"{path}: no space left on device")
    return file_error("invalid", f"{path}: {exc.strerror}")


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
    except OSError as exc:
        return path_error(exc, raw_path, missing=f"{raw_path}: no such file")
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
