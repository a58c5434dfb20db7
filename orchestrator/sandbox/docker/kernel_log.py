"""The host kernel's own record of a memory-cgroup OOM kill, for a container that died.

Docker's ``State.OOMKilled`` is not reliable evidence that a container's memory limit
killed it: containerd's shim reports the OOM (TaskOOM) and the exit (TaskExit) from
separate goroutines, and an OOM event published after the exit, or lost, leaves
``OOMKilled: false`` on a container the kernel OOM-killed (containerd issues 8180 and
8893). Seen here in a full suite run: a gVisor sandbox whose agent ran six 120 MB
allocations under a 256 MB limit exited 137 with ``OOMKilled: false``, where the same act
is otherwise reported OOM-killed. Under gVisor the kernel kills the sandbox's sentry, so
the whole sandbox dies, and taking that for an infrastructure fault would discard a
sample the agent caused (docs/failure-model.md).

The kernel logs every memcg OOM kill with the memory cgroup's path, which holds the
container's id (``oom-kill:constraint=CONSTRAINT_MEMCG,...,oom_memcg=/docker/<id>``, or
``.../docker-<id>.scope`` under systemd). Reading ``/dev/kmsg`` needs root (CAP_SYSLOG), as
a Docker-backend worker has; without it the answer is "no evidence", never an error. The
summary line is rate-limited by the kernel (10 per 5 s): a burst of OOM kills on one host
can hide one, which then reads as ours, as before.
"""

from __future__ import annotations

import errno
import os

KMSG = "/dev/kmsg"
# The kernel's summary line of one OOM kill (mm/oom_kill.c, dump_oom_summary).
OOM_SUMMARY = "oom-kill:constraint="


def memcg_oom_killed(container_id: str, path: str = KMSG) -> bool | None:
    """Whether the kernel's log holds a memory-cgroup OOM kill in ``container_id``'s
    cgroup: True or False, or None when the log cannot be read here."""
    if len(container_id) < 12:
        return None  # a prefix this short could name another container
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return any(OOM_SUMMARY in message and container_id in message for message in _records(fd))
    finally:
        os.close(fd)


def _records(fd: int) -> list[str]:
    """Every record the kernel still holds: one ``read`` per record, until none is left."""
    messages: list[str] = []
    while True:
        try:
            record = os.read(fd, 8192)
        except OSError as exc:
            if exc.errno == errno.EAGAIN:
                return messages  # the end of the ring buffer
            if exc.errno == errno.EPIPE:
                continue  # the buffer wrapped past this record: the next one follows
            return messages
        if not record:
            return messages
        _, _, message = record.decode(errors="replace").partition(";")
        messages.append(message)
