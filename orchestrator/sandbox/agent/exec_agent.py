"""Exec agent: the first process of every sandbox, answering over a Unix socket (Docker)
or over TCP with a per-sandbox token (Kubernetes pods, see docs/kubernetes-backend.md).

Runs *inside* the sandbox with the image's own python3, so it uses the standard library only
and must stay compatible with Python 3.9+. One JSON request per connection, one JSON reply.

This module is its entry (:func:`main`) and its ops (:class:`Agent`); the rest sits beside
it, a module per concern, imported by name from the same directory in a sandbox
(sandbox/agent/__init__.AGENT_MODULES): its wire (agent_protocol), its server
(agent_server), commands as processes (agent_processes), the limits a command hit
(agent_limits) and the filesystem (agent_files).

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
import errno
import json
import os
import re
import selectors
import signal
import subprocess
import threading
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, TypeAlias

    from orchestrator.sandbox.agent.agent_processes import Spawned

    # A running command: started by run-as (Spawned) or, without one, by subprocess.
    Command: TypeAlias = "subprocess.Popen[bytes] | Spawned"

    from orchestrator.sandbox.agent import (
        agent_files,
        agent_limits,
        agent_processes,
        agent_server,
    )
    from orchestrator.sandbox.agent import agent_protocol as protocol
else:
    try:  # in a sandbox: the files beside this one (their directory is first on sys.path)
        import agent_files
        import agent_limits
        import agent_processes
        import agent_protocol as protocol
        import agent_server
    except ImportError:  # imported on the host (run-as's constants, tests)
        from orchestrator.sandbox.agent import (
            agent_files,
            agent_limits,
            agent_processes,
            agent_server,
        )
        from orchestrator.sandbox.agent import agent_protocol as protocol

READ_CHUNK = 65536
# How long a finished command's background children may keep its pipes open before the
# process group is killed: commands must not leave processes behind.
DRAIN_AFTER_EXIT_S = 0.1
# Without a pidfd (old gVisor), how often a running command is polled for its exit, and
# the first interval once its streams have closed (doubling up to POLL_S).
POLL_S = 0.005
POLL_AFTER_CLOSE_S = 0.0002


class Agent:
    """Runs commands and reads files as ``uid``/``gid``, never as itself."""

    def __init__(
        self,
        uid: int,
        gid: int,
        home: str,
        preload: str | None,
        wrapper: str,
        limits: agent_limits.Limits,
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
        sandbox's before the sandbox serves another (:func:`agent_files.sandbox_manifest`)."""
        return agent_files.sandbox_manifest()

    def scrub(self, req: dict[str, object]) -> dict[str, object]:
        """The sandbox's half of a reset in place (the host renews /workspace): every
        process of the agent's user ended, its System V IPC objects removed, every writable
        tree but /workspace emptied of what the user put there, and the trees' roots given
        back the modes ``modes`` names (a fresh sandbox's). ``processes``: those that
        outlived ``timeout_s``, which fail the reset; the host's audit that follows judges
        the rest."""
        left = agent_processes.end_processes_of(self.uid, float(req.get("timeout_s") or 10))  # type: ignore[arg-type]
        if left:
            return {"processes": left}
        modes = {str(k): int(v) for k, v in dict(req.get("modes") or {}).items()}  # type: ignore[call-overload]
        points = agent_files.writable_trees(agent_files.mount_table())

        def as_user(_req: dict[str, object]) -> dict[str, object]:
            kept = [path for point in points for path in agent_files.empty_tree(point)]
            for point in points:
                if point in modes and os.lstat(point).st_uid == self.uid:
                    os.chmod(point, modes[point])
            return {"ipc": agent_files.remove_sysv_ipc(), "kept": kept}

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
        left = agent_processes.end_processes_of(self.uid, float(req.get("timeout_s") or 10))  # type: ignore[arg-type]
        if left:
            return {"processes": left}
        return self._as_user(req, agent_files.stage_files)

    def pack(self, req: dict[str, object]) -> dict[str, object]:
        """What the sandbox's user left in its writable trees but /workspace (/tmp, its
        home, scratch directories: memory the host cannot read under gVisor), as that user
        reads it, into one tar file at ``to``, which only root here may write (the socket
        directory): a snapshot's half beside /workspace's upper layer, which the host
        copies (sandbox/docker/snapshots.py). ``skipped``: what the user could not read."""
        points = agent_files.user_trees()
        fd = os.open(str(req["to"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            return self._as_user(req, lambda _r: agent_files.pack_trees(points, fd))
        finally:
            os.close(fd)

    def unpack(self, req: dict[str, object]) -> dict[str, object]:
        """A :meth:`pack` file (at ``path``) extracted as the sandbox's user, into its
        writable trees only: a sandbox made from a snapshot gets back what its parent's
        user had there."""
        points = agent_files.user_trees()
        fd = os.open(str(req["path"]), os.O_RDONLY | os.O_NOFOLLOW)
        try:
            return self._as_user(req, lambda _r: agent_files.unpack_trees(points, fd))
        finally:
            os.close(fd)

    def exec(self, req: dict[str, object], emit: Any = None) -> dict[str, object]:
        """Run a command; with ``emit``, its output is also given to ``emit(stream, data)``
        as it is read, up to the budget per stream (what is kept is the same either way)."""
        cwd = str(req.get("cwd") or agent_files.WORKSPACE)
        argv = req.get("argv")
        if argv is not None:
            if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
                raise ValueError("argv must be a non-empty list of strings")
            args = [self.wrapper + agent_processes.RUN_ARGV, "bash", cwd, *argv]
        else:
            args = [self.wrapper + agent_processes.RUN_SHELL, "bash", cwd, str(req["command"])]
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
                proc: Command = agent_processes.spawn_on_terminal(
                    self.run_as, self.uid, self.gid, ["/bin/bash", "-c", *args], env,
                    int(terminal["rows"]), int(terminal["cols"]),
                )  # fmt: skip
            else:
                proc = self._start(["/bin/bash", "-c", *args], env, stdin=bool(req.get("stdin")))
        except OSError as exc:
            # EAGAIN here is usually the sandbox's pids limit, hit by the agent's own
            # processes; spawn_failure says whether they fill it.
            return self.limits.spawn_failure(exc)
        captures = {
            proc.stdout: agent_processes.Capture(budget),
            proc.stderr: agent_processes.Capture(budget),
        }
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
            details.append(
                agent_limits.hit("output", self.limits.output_mb, "MB", evidence, killed=True)
            )
        elif killed_for == "timeout":
            evidence = "still running at the deadline"
            details.append(agent_limits.hit("timeout", timeout, "s", evidence, killed=True))
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
            return agent_processes.spawn_as(self.run_as, self.uid, self.gid, argv, env, stdin)
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
        captures: dict[Any, agent_processes.Capture],
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
        pidfd = agent_processes.open_pidfd(proc.pid)
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
                fork_failed = any(
                    agent_limits.mentions([c.text()], agent_limits.FORK_FAILED_TEXT)
                    for c in captures.values()
                )
                if running or proc.returncode != 0 or fork_failed:
                    nproc_full = self.limits.processes_at_limit(fork_failed=fork_failed)
            if running:
                agent_processes.kill_tree(proc.pid)
            proc.wait()
            # Whatever the command left running in its process group goes too.
            agent_processes.kill_group(proc.pid)
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
            agent_processes.kill_tree(proc.pid)
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
                agent_processes.set_terminal_size(proc.stdin.fileno(), int(size[0]), int(size[1]))
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
        return self._as_user(req, agent_files.read_lines)

    def files(self, req: dict[str, object]) -> dict[str, object]:
        """A filesystem operation (:func:`agent_files.file_op`) as the unprivileged user,
        anywhere it may go: what an E2B client's ``files`` API does."""
        return self._as_user(req, lambda r: agent_files.file_op(r, self.home))

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
            return agent_files.file_error("pids_limit", message)
        if pid == 0:  # child
            code = 0
            try:
                os.close(rfd)
                os.setgroups([])
                os.setgid(self.gid)
                os.setuid(self.uid)
                reply = work(req)
            except BaseException as exc:  # noqa: BLE001 - the child must always answer
                reply = agent_files.file_error(protocol.INTERNAL, repr(exc))
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


def main() -> None:
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
        default=agent_processes.RUN_AS,
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
    token = None
    if args.token_file:
        with open(args.token_file, "rb") as f:
            token = f.read().strip()
        if not token:
            parser.error(f"{args.token_file} holds no token")
    elif address.startswith("tcp:"):
        parser.error("--listen tcp: requires --token-file")
    uid, gid = args.uid, args.gid
    if os.getuid() == uid:
        # Commands as the agent's own user could kill or stop it: whatever the agent did to
        # its sandbox would then end it as if we had, and it would be discarded, not scored.
        parser.error(f"the agent must not run as uid {uid}, the uid its commands run as")
    run_as = agent_processes.trusted_run_as(args.run_as)
    if args.run_as and run_as is None and os.path.lexists(args.run_as):
        agent_processes.log(
            f"not using {args.run_as}: it or a directory above it is not root's alone"
        )
    if run_as is not None:
        try:
            agent_processes.keep_inheritable()
        except OSError as exc:
            agent_processes.log(f"not using {run_as}: {exc}")
            run_as = None
    agent_processes.drop_bounding_set()
    wrapper = agent_processes.shell_wrapper(args.limit_as_mb, args.limit_nproc)
    limits = agent_limits.Limits(args.limits, uid, args.limit_as_mb, args.limit_nproc)
    agent = Agent(uid, gid, args.home, args.preload, wrapper, limits, run_as)
    server = agent_server.listen(address, agent, token)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    how = f"through {run_as}" if run_as else "by fork"
    agent_processes.log(
        f"listening on {address} (pid {os.getpid()}), running commands as uid {uid} {how}"
    )
    agent_server.Acceptors(server).serve_forever()


if __name__ == "__main__":
    main()
