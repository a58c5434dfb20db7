"""The exec agent that runs inside every sandbox: a set of modules side by side, standard
library only (:data:`AGENT_MODULES`), which every backend puts in one directory of the
sandbox; and what every backend gives it."""

from __future__ import annotations

import hashlib
import json
import os
import py_compile
import sys
import uuid
from pathlib import Path

from orchestrator.sandbox.backend import SandboxSpec

AGENT_MODULES = {
    name: Path(__file__).with_name(f"{name}.py")
    for name in (
        "exec_agent",  # its entry (main) and its ops (Agent)
        "agent_protocol",  # its wire, shared with the host's client (client.py)
        "agent_server",  # the socket or TCP server, one request per connection
        "agent_processes",  # commands as processes: run-as, terminals, trees ended
        "agent_limits",  # which of the sandbox's limits a command hit, and their values
        "agent_files",  # files, the manifest a reset is audited by, staging and packing
    )
}
"""Every module of the agent, by name: each imports the others by name from its own
directory, so every backend puts them all side by side (Docker: a read-only bind mount
each; Kubernetes: a key each of the sandbox's Secret)."""
EXEC_AGENT_PATH = AGENT_MODULES["exec_agent"]

SANDBOX_UID = 1000
"""The unprivileged user (and group) every command runs as, in every backend's sandboxes."""
SANDBOX_HOME = "/home/agent"
AGENT_CAPABILITIES = ["SETUID", "SETGID", "SETPCAP", "KILL"]
"""All the agent keeps (it runs as root): to run commands as SANDBOX_UID, to empty its
bounding set before running anything, and to kill a command's process group. Pod Security
"baseline" allows each."""
HOME_MB = 16
"""Size of the tmpfs at the sandbox user's home."""
# Built into the base image (sandbox_images/base/gvisor-compat): makes coreutils work on
# old gVisor releases.
GVISOR_COMPAT_PRELOAD = "/opt/orchestrator/lib/statx_compat.so"

# Starts the agent as an imported module, not as a script: Python reads an imported
# module's bytecode from __pycache__ next to its source (a script is compiled every time),
# and a sandbox's read-only root can never write one. Its path stays on the command line
# (argv[1]), so the agent shows in `ps` as before.
AGENT_LOADER = (
    "import os, sys; path = sys.argv[1]; sys.path.insert(0, os.path.dirname(path)); "
    "import exec_agent; sys.argv = sys.argv[1:]; exec_agent.main()"
)


def publish(partial: Path, target: Path) -> None:
    """Put the whole file ``partial`` at ``target`` unless a file is there already (one of
    the same contents, made by a racing thread or process): never replaced, since a
    sandbox starting now may be mounting it, and runc refuses a mount whose source changed
    under it (a sandbox of a loaded first burst failed so: "mount ... run-as ...: no such
    file or directory"). ``partial`` is gone after."""
    try:
        os.link(partial, target)
    except FileExistsError:
        pass
    finally:
        partial.unlink(missing_ok=True)


def compiled_agent(modules: dict[str, Path], cache_root: Path) -> Path:
    """A directory holding the bytecode of the agent's ``modules`` (by name: normally
    :data:`AGENT_MODULES`) as Python looks for it in ``__pycache__``
    (``<module>.<this interpreter's tag>.pyc``, checked against each source's mtime and
    size), to mount at the sandbox's ``__pycache__`` next to the agent's sources. A sandbox
    whose Python is this host's version then skips compiling the agent at every start
    (about 20 ms of CPU of a sandbox's 250: bench/create_cost.py); any other Python finds
    no file of its tag and compiles the sources, as it always did."""
    sources = modules
    stats = {path: path.stat() for path in sources.values()}
    stamp = ";".join(f"{path}:{st.st_mtime_ns}:{st.st_size}" for path, st in stats.items())
    key = hashlib.sha256(stamp.encode()).hexdigest()
    directory = cache_root / key[:16]
    for module, path in sources.items():
        target = directory / f"{module}.{sys.implementation.cache_tag}.pyc"
        if target.exists():
            continue
        directory.mkdir(parents=True, exist_ok=True)
        # Written under another name, then renamed: a sandbox never mounts half a file.
        # The name is this call's own: the creations of one worker's threads race here at
        # a fresh state_dir, and a name per process let one rename the other's file away
        # (FileNotFoundError: a first burst's sandbox failed to create, bench/datasets.py).
        partial = directory / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}"
        py_compile.compile(str(path), cfile=str(partial), doraise=True)
        publish(partial, target)
    return directory


def agent_arguments(spec: SandboxSpec, *, disk_mb: int, output_mb: int) -> list[str]:
    """The exec agent's arguments whatever the backend (each adds where it listens): the
    user commands run as and its home, the limits (to say which one a command hit, and its
    value), and per-process limits where the sandbox has a kernel of its own."""
    limits = spec.limits
    arguments = [
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_UID),
        "--home",
        SANDBOX_HOME,
        "--limits",
        json.dumps(
            {
                "memory_mb": limits.memory_mb,
                "pids": limits.pids,
                "output_mb": output_mb,
                "disk": {
                    "/workspace": disk_mb,
                    "/tmp": limits.tmp_mb,
                    SANDBOX_HOME: HOME_MB,
                    **{d.path: d.size_mb for d in spec.scratch_dirs},
                },
            }
        ),
    ]
    if spec.runtime == "runsc":
        # See agent_processes.shell_wrapper: gVisor ends the whole sandbox at its memory limit,
        # so commands get a per-process limit below it.
        arguments += ["--preload", GVISOR_COMPAT_PRELOAD]
        arguments += ["--limit-as-mb", str(limits.memory_mb * 3 // 4)]
    if spec.runtime in ("runsc", "kata"):
        # The sandbox's process limit from inside: in a sandbox with a kernel of its own,
        # RLIMIT_NPROC counts only that sandbox's processes (under runc it would count the
        # same uid on the whole host), and under gVisor the cgroup's pids limit counts the
        # sandbox kernel's host threads, a crash when hit (the cgroup's is a backstop).
        arguments += ["--limit-nproc", str(limits.pids)]
    return arguments
