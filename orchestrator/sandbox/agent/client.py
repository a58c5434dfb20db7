"""Host side of the exec-agent protocol: one JSON request, one JSON reply per connection."""

from __future__ import annotations

import base64
import json
import os
import socket
import time
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

from orchestrator.sandbox.agent import agent_protocol as protocol
from orchestrator.sandbox.backend import (
    ExecResult,
    FileAction,
    FileError,
    FileOpResult,
    InputClosed,
    ProbeResult,
    ReadFileResult,
    SandboxBackend,
    SandboxError,
    SandboxHandle,
    SandboxUnavailable,
    StageResult,
    StreamCapture,
)

# Slack on top of a command's own timeout: the agent enforces the timeout itself, then
# kills the process group and replies; waiting longer than this means the agent is stuck.
REPLY_SLACK_S = 10.0
# How long a read_file may take in the agent: bounded by its byte cap, not by a command.
READ_FILE_TIMEOUT_S = 20.0
# A pod's agent that does not accept a connection within this is not there (over TCP a
# vanished pod IP may drop packets instead of refusing).
CONNECT_TIMEOUT_S = 5.0
# A probe of a running sandbox waits this long for its agent's answer before it calls the
# agent silent, retrying with growing timeouts: on a host at load average 47 on 2 cores a
# 5 s `true` timed out although the sandbox was fine. Slow is not dead.
PROBE_BUDGET_S = 30.0
# ...and this long when the host is overloaded (load average per core above
# PROBE_LOADED_PER_CPU), where an answer can take longer still.
PROBE_LOADED_BUDGET_S = 60.0
PROBE_LOADED_PER_CPU = 4.0
PROBE_FIRST_TRY_S = 5.0
# After an agent stopped answering, how long a probe watches the sandbox for its end, so
# the evidence is the end and its cause rather than "running but silent".
PROBE_SETTLE_S = 3.0
PROBE_MAX_S = PROBE_LOADED_BUDGET_S + PROBE_SETTLE_S
"""The longest one probe takes, whatever it finds."""


class AgentProtocolError(SandboxError):
    """The agent answered something that is not a valid reply."""


class AgentNotListening(SandboxUnavailable):
    """Nothing accepts the agent's connection (no socket, refused): the agent is gone."""


class AgentSilent(SandboxUnavailable):
    """The agent accepted the connection (or its address swallowed it) but did not answer
    in time: a paused or lost sandbox, or only an overloaded host."""


class AgentUnauthorized(AgentProtocolError):
    """The agent refused the request's token: over TCP, the address is another sandbox's
    (a dead pod's IP given to a new pod)."""


class CommandSpawnFailed(SandboxError):
    """The agent could not start the command (fork failed, e.g. the pids limit is hit)."""


Watch = Callable[[], str | None]
OnChunk = Callable[[str, bytes], None]
"""Given a streamed command's output as it is printed: the stream's name, the bytes."""
"""Asked while a reply is slow to come: why waiting is pointless (the sandbox is paused,
stopped or gone: what its backend says), or None to go on waiting."""
# A slow reply is looked into after these many seconds, then at twice the interval, up to
# the last: a paused sandbox accepts the connection and never answers, and its call would
# otherwise wait for its whole timeout (seen: 15 s for a `true` of 5 s).
WATCH_FIRST_S = 1.0
WATCH_MAX_S = 8.0


def call_unix(
    socket_path: str,
    request: dict[str, Any],
    timeout_s: float,
    watch: Watch | None = None,
    on_chunk: OnChunk | None = None,
) -> dict[str, Any]:
    """Send one request to the agent listening on ``socket_path``; return its result.
    ``on_chunk``: given each piece of a streamed command's output (:func:`exec_request`'s
    ``stream``) as it comes."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        try:
            sock.connect(socket_path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise AgentNotListening(f"exec agent not listening ({exc.strerror})") from exc
        except TimeoutError as exc:
            raise AgentSilent(f"exec agent did not answer within {timeout_s:.1f} s") from exc
        except OSError as exc:
            raise SandboxUnavailable(f"exec agent connection failed: {exc}") from exc
        raw = _exchange(sock, request, timeout_s, watch, on_chunk)
    finally:
        sock.close()
    return parse_reply(raw)


def call_tcp(
    host: str,
    port: int,
    token: str,
    request: dict[str, Any],
    timeout_s: float,
    watch: Watch | None = None,
    on_chunk: OnChunk | None = None,
) -> dict[str, Any]:
    """Send one request, carrying the sandbox's ``token``, to the agent listening on TCP
    (a Kubernetes pod's IP); return its result. A refused token is an
    :class:`AgentProtocolError`, as is any other reply that is not a result."""
    try:
        sock = socket.create_connection((host, port), timeout=min(timeout_s, CONNECT_TIMEOUT_S))
    except TimeoutError as exc:
        raise AgentSilent(f"exec agent at {host}:{port} did not accept in time") from exc
    except OSError as exc:
        raise AgentNotListening(f"exec agent at {host}:{port} not listening ({exc})") from exc
    sock.settimeout(timeout_s)
    try:
        raw = _exchange(sock, {**request, "token": token}, timeout_s, watch, on_chunk)
    finally:
        sock.close()
    return parse_reply(raw)


def _exchange(
    sock: socket.socket,
    request: dict[str, Any],
    timeout_s: float,
    watch: Watch | None,
    on_chunk: OnChunk | None = None,
) -> bytes:
    """Write one JSON request line on a connected socket and read the reply line; while
    the reply is slow, ask ``watch`` whether to stop waiting. With ``on_chunk``, the lines
    of output before the reply go to it (only a streamed exec sends them)."""
    deadline = time.monotonic() + timeout_s
    interval = WATCH_FIRST_S
    try:
        sock.sendall(json.dumps(request).encode() + b"\n")
        chunks: list[bytes] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if watch is not None:
                sock.settimeout(min(left, interval))
            try:
                chunk = sock.recv(1 << 16)
            except TimeoutError:
                reason = watch() if watch is not None else None
                if reason is not None:
                    raise SandboxUnavailable(f"exec agent cannot answer: {reason}") from None
                interval = min(interval * 2, WATCH_MAX_S)
                continue
            if not chunk:
                break
            chunks.append(chunk)
            if on_chunk is not None and b"\n" in chunk:
                lines = b"".join(chunks).split(b"\n")
                chunks = [lines.pop()]  # the part after the last newline
                for line in lines:
                    if not line.startswith(protocol.CHUNK_PREFIX):
                        return line
                    stream, data = json.loads(line)["chunk"]
                    on_chunk(stream, base64.b64decode(data))
                continue
            if chunk.endswith(b"\n"):
                break
    except TimeoutError as exc:
        raise AgentSilent(f"exec agent did not answer within {timeout_s:.1f} s") from exc
    except OSError as exc:
        raise SandboxUnavailable(f"exec agent connection failed: {exc}") from exc
    return b"".join(chunks)


def parse_reply(raw: bytes) -> dict[str, Any]:
    """Unwrap ``{"ok": true, "result": ...}``; anything else is an infrastructure fault."""
    if not raw:
        raise SandboxUnavailable("exec agent closed the connection without a reply")
    try:
        reply = json.loads(raw)
    except ValueError as exc:
        raise AgentProtocolError(f"exec agent sent invalid JSON: {raw[:200]!r}") from exc
    if not isinstance(reply, dict) or not reply.get("ok"):
        error = reply.get("error") if isinstance(reply, dict) else reply
        if isinstance(reply, dict) and reply.get("kind") == protocol.Refusal.UNAUTHORIZED:
            raise AgentUnauthorized(f"exec agent failed: Unauthorized: {error}")
        raise AgentProtocolError(f"exec agent failed: {error}")
    result = reply.get("result")
    if not isinstance(result, dict):
        raise AgentProtocolError("exec agent reply has no result")
    return result


def exec_result(result: dict[str, Any]) -> ExecResult:
    """The agent's exec reply as an :class:`ExecResult`.

    A command that could not start is an infrastructure fault (:class:`CommandSpawnFailed`)
    unless the agent blamed the agent's own processes for it (they fill the pids limit):
    then it is a result whose ``limits_hit`` says ``pids``, with the error as its stderr.
    """
    if "spawn_error" not in result:
        return ExecResult.model_validate(result)
    message = f"could not start the command: {result['spawn_error']}"
    if "pids" not in (result.get("limits_hit") or []):
        raise CommandSpawnFailed(message)
    text = message + "\n"
    size = len(text.encode())
    return ExecResult(
        exit_code=None,
        stdout=StreamCapture(),
        stderr=StreamCapture(head=text, total_bytes=size, kept_bytes=size),
        duration_ms=0.0,
        limits_hit=result["limits_hit"],
        limit_details=result.get("limit_details") or [],
    )


def file_op_result(result: dict[str, Any]) -> FileOpResult:
    """The agent's ``files`` reply: its result, or the path's problem as a FileError."""
    error = result.get("error")
    if isinstance(error, dict):
        kind = error.get("kind")
        if kind == protocol.INTERNAL:
            raise AgentProtocolError(f"a file operation failed inside the agent: {error}")
        raise FileError(kind, str(error.get("message")))  # type: ignore[arg-type]
    if "data" in result:
        result = {**result, "data": base64.b64decode(result["data"])}
    return FileOpResult.model_validate(result)


def read_file_result(result: dict[str, Any]) -> ReadFileResult:
    error = result.get("error")
    if isinstance(error, dict):
        kind = error.get("kind")
        if kind == protocol.INTERNAL:
            raise AgentProtocolError(f"read_file failed inside the agent: {error.get('message')}")
        raise FileError(kind, str(error.get("message")))  # type: ignore[arg-type]
    return ReadFileResult.model_validate(result)


def host_load() -> float:
    """This host's 1-minute load average per core."""
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def probe_from_exec(result: ExecResult, state: str, latency_ms: float) -> ProbeResult:
    """A running sandbox's probe from the trivial command it ran: healthy; or unusable by
    the agent's own doing when ``true`` could not start for the agent's processes filling
    the pids limit; healthy but slow when it ran out of time (the agent answered, so the
    host or the agent's own processes are busy, nothing is broken); or unhealthy (ours)
    for any other failure."""
    if "pids" in result.limits_hit:
        hit = result.limit("pids")
        return ProbeResult(
            alive=True,
            state=state,
            agent_ok=False,
            latency_ms=latency_ms,
            agent_caused="pids_limit",
            detail=f"`true` could not start: {hit.evidence if hit else 'pids limit'}",
        )
    if result.timed_out:
        return ProbeResult(
            alive=True,
            state=state,
            agent_ok=True,
            slow=True,
            latency_ms=latency_ms,
            detail=f"slow: `true` did not finish in time (host load {host_load():.1f} per core)",
        )
    ok = result.exit_code == 0
    detail = "" if ok else f"`true` gave exit {result.exit_code}"
    return ProbeResult(alive=True, state=state, agent_ok=ok, latency_ms=latency_ms, detail=detail)


class AgentBackend(SandboxBackend):
    """A backend whose sandboxes run the exec agent: ``exec`` and ``read_file`` are one
    request each, and a backend says only how a request reaches its sandbox's agent."""

    @abstractmethod
    def _call(
        self,
        handle: SandboxHandle,
        request: dict[str, Any],
        timeout_s: float,
        on_chunk: OnChunk | None = None,
    ) -> dict[str, Any]:
        """Send ``request`` to the agent of ``handle``; return its result (``on_chunk``:
        as :func:`call_unix`)."""

    def stage(
        self,
        handle: SandboxHandle,
        *,
        purge: list[str],
        keep: list[str],
        remove: list[str],
        write: dict[str, bytes],
        timeout_s: float = 30.0,
    ) -> StageResult:
        """See :meth:`SandboxBackend.stage`: one request to the agent (exec_agent.stage)."""
        request = protocol.stage_request(
            purge=purge, keep=keep, remove=remove, write=write, timeout_s=timeout_s
        )
        done = self._call(handle, request, timeout_s + 30)
        if done.get("processes"):
            raise SandboxError(
                f"processes of the agent's user outlived the staging: {done['processes'][:5]}"
            )
        if "error" in done:
            raise SandboxError(f"staging the workspace failed: {done['error']}")
        return StageResult.model_validate(done)

    @abstractmethod
    def _still_running(self, handle: SandboxHandle) -> bool:
        """Whether the backend still reports the sandbox running (not stopped, paused or
        gone): a probe retries a silent agent only while it is."""

    def _probe_agent(self, handle: SandboxHandle, state: str) -> ProbeResult | None:
        """The probe of a sandbox the backend reports running, through its agent; None when
        the agent is gone or stays silent past the probe's budget (the caller then reads
        how the sandbox ended). Slow is not dead: a silent agent is asked again, with
        growing timeouts, for :data:`PROBE_BUDGET_S` (longer on an overloaded host) as long
        as the sandbox still runs; an agent that answers is alive however slow its
        commands are, and ``true`` then only says whether a command can start."""
        started = time.monotonic()
        budget = PROBE_LOADED_BUDGET_S if host_load() > PROBE_LOADED_PER_CPU else PROBE_BUDGET_S
        attempt = PROBE_FIRST_TRY_S
        while True:
            remaining = budget - (time.monotonic() - started)
            try:
                self._call(handle, protocol.ping(), max(1.0, min(attempt, remaining)))
                break
            except AgentSilent:
                if remaining <= attempt or not self._still_running(handle):
                    return None
                attempt *= 2
            except SandboxError:
                return None  # not listening, or a broken answer: no agent to probe
        remaining = max(PROBE_FIRST_TRY_S, budget - (time.monotonic() - started))
        try:
            # cwd "/": the agent may have made /workspace unusable; that is not ill health.
            result = self.exec(
                handle, "true", timeout_s=remaining, output_budget_bytes=256, cwd="/"
            )
        except AgentSilent:
            result = None
        except SandboxError as exc:
            return ProbeResult(alive=True, state=state, agent_ok=False, detail=str(exc))
        latency = round((time.monotonic() - started) * 1000, 2)
        if result is None:  # it answered a ping a moment ago: busy, not dead
            return ProbeResult(
                alive=True,
                state=state,
                agent_ok=True,
                slow=True,
                latency_ms=latency,
                detail=f"slow: the agent answers but `true` got no reply in {remaining:.0f} s "
                f"(host load {host_load():.1f} per core)",
            )
        return probe_from_exec(result, state, latency)

    def exec(
        self,
        handle: SandboxHandle,
        command: str | list[str],
        *,
        timeout_s: float,
        output_budget_bytes: int,
        cwd: str = "/workspace",
        env: dict[str, str] | None = None,
        exec_id: str | None = None,
        on_output: OnChunk | None = None,
        stdin: bool = False,
        pty: tuple[int, int] | None = None,
    ) -> ExecResult:
        stream = on_output is not None
        request = protocol.exec_request(
            command, timeout_s, output_budget_bytes, cwd, env, exec_id, stream, stdin, pty
        )
        return exec_result(self._call(handle, request, timeout_s + REPLY_SLACK_S, on_output))

    def send_input(
        self,
        handle: SandboxHandle,
        exec_id: str,
        data: bytes,
        *,
        close: bool = False,
        resize: tuple[int, int] | None = None,
    ) -> bool:
        request = protocol.input_request(exec_id, data, close=close, resize=resize)
        done = self._call(handle, request, REPLY_SLACK_S)
        if "error" in done:
            raise InputClosed(str(done["error"]))
        return bool(done["found"])

    def signal_exec(self, handle: SandboxHandle, exec_id: str, *, kill: bool = True) -> bool:
        request = protocol.signal_request(exec_id, kill=kill)
        return bool(self._call(handle, request, REPLY_SLACK_S)["found"])

    def file_op(
        self,
        handle: SandboxHandle,
        action: FileAction,
        path: str,
        *,
        target: str | None = None,
        depth: int = 1,
        data: bytes | None = None,
        max_bytes: int = 0,
    ) -> FileOpResult:
        request = protocol.files_request(
            action, path, target=target, depth=depth, data=data, max_bytes=max_bytes
        )
        # Bounded by the bytes moved, not by a command: the read allowance, per 16 MB.
        size = len(data or b"") + max_bytes
        allowance = READ_FILE_TIMEOUT_S * (1 + size // (16 << 20))
        return file_op_result(self._call(handle, request, REPLY_SLACK_S + allowance))

    def read_file(
        self,
        handle: SandboxHandle,
        path: str,
        *,
        start_line: int = 1,
        end_line: int | None = None,
        max_bytes: int,
    ) -> ReadFileResult:
        request = protocol.read_file_request(path, start_line, end_line, max_bytes)
        # Reading is bounded by max_bytes, not by a command: a fixed allowance.
        return read_file_result(self._call(handle, request, REPLY_SLACK_S + READ_FILE_TIMEOUT_S))
