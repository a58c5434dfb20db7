"""The E2B sandbox plane (what the SDK calls "envd", docs/e2b.md), on the API's own port:
the SDK sends every sandbox's requests to its sandbox URL with the sandbox named by the
``E2b-Sandbox-Id`` header and its access token in ``X-Access-Token``.

- ``process.Process``: ``Start`` (a command: its start event at once, then its output and
  its end), ``Connect`` (the same for a running command, by pid), ``List``,
  ``SendSignal`` (kill); stdin, PTYs and ``Update`` are refused (``unimplemented``).
- ``filesystem.Filesystem``: ``Stat``, ``ListDir``, ``MakeDir``, ``Remove``, ``Move``;
  watchers are refused.
- ``/files``: read (``GET``) and write (``POST``, multipart or octet-stream) whole files.
- ``/health``: 204 while the sandbox lives.

Errors say whose doing they are: a command's own failure is its exit status (the SDK
raises ``CommandExitException``); a sandbox that ended (killed, past its timeout) is
``unavailable`` "... was not found" (``SandboxNotRunningException``); a sandbox that failed
for infrastructure reasons is ``unavailable`` naming the cause
(``SandboxUnreachableException``), never a command's failure.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from orchestrator.api.deps import state
from orchestrator.e2b import connect
from orchestrator.e2b.connect import Code, ConnectError
from orchestrator.e2b.models import (
    ROOT_USER,
    SANDBOX_USER,
    E2BState,
    MoveRequest,
    PathRequest,
    SelectorRequest,
    SendInputRequest,
    SendSignalRequest,
    StartRequest,
    UpdateRequest,
    WatcherRequest,
    WatchRequest,
    data_event,
    entry_json,
    process_event,
)
from orchestrator.e2b.sandboxes import E2BSandboxes, FileProblem, Pieces, Process, SandboxGone
from orchestrator.environments.models import E2BRootUser
from orchestrator.outcomes import Outcome
from orchestrator.rollouts.errors import InfraError, Rejected
from orchestrator.state.admission import AtCapacity
from orchestrator.state.records import Rollout
from orchestrator.tools.command import CommandOutput

router = APIRouter(include_in_schema=False)
# An idle stream gets a keepalive event this often (proxies drop silent connections).
KEEPALIVE_S = 20.0
WATCH_POLL_S = 0.5
"""How often a ``WatchDir`` stream looks at its directory."""
# FileProblem kinds as Connect codes, and as /files HTTP statuses.
_FILE_CODES = {
    "not_found": Code.NOT_FOUND,
    "exists": Code.ALREADY_EXISTS,
    "permission": Code.PERMISSION_DENIED,
    "too_large": Code.RESOURCE_EXHAUSTED,
    "no_space": Code.RESOURCE_EXHAUSTED,
}
_FILE_STATUS = {"not_found": 404, "permission": 403, "too_large": 413, "no_space": 507}


async def sandboxes(request: Request) -> E2BSandboxes:
    found: E2BSandboxes = state(request).e2b
    return found


Sandboxes = Annotated[E2BSandboxes, Depends(sandboxes)]


def gone(exc: SandboxGone) -> ConnectError:
    return ConnectError(Code.UNAVAILABLE, str(exc))


def failed(exc: InfraError) -> ConnectError:
    """A sandbox that failed for infrastructure reasons: the client can tell it from a
    command's failure (its exit status) and from a sandbox it ended itself."""
    return ConnectError(
        Code.UNAVAILABLE,
        f"sandbox {exc.rollout_id} failed for infrastructure reasons ({exc.code}): "
        f"{exc.message}; not the command's doing",
    )


async def _sandbox(request: Request, svc: E2BSandboxes) -> tuple[Rollout, E2BState]:
    sandbox_id = request.headers.get("e2b-sandbox-id", "")
    token = request.headers.get("x-access-token", "")
    try:
        return await svc.authorized(sandbox_id, token)
    except SandboxGone as exc:
        raise gone(exc) from exc
    except InfraError as exc:
        raise failed(exc) from exc
    except AtCapacity as exc:  # a paused sandbox's resume found no slot on its host
        raise ConnectError(Code.RESOURCE_EXHAUSTED, f"{exc.message}; try again") from exc
    except Rejected as exc:
        raise ConnectError(Code.FAILED_PRECONDITION, exc.message) from exc


def _user(svc: E2BSandboxes, rollout: Rollout, request: Request, name: str | None = None) -> None:
    """Commands and files are the sandbox user's (uid 1000): another user is refused. User
    ``root`` is that same user where the sandbox's environment says ``e2b.root_user:
    alias`` (docs/e2b.md, "Harbor"): a name accepted, no privilege granted."""
    if name is None:
        header = request.headers.get("authorization", "")
        if header.lower().startswith("basic "):
            try:
                name = base64.b64decode(header[6:]).decode().partition(":")[0]
            except ValueError:
                name = header
    if not name or name == SANDBOX_USER:
        return
    aliased = svc.service.environment_of(rollout).environment.e2b.root_user
    if name == ROOT_USER and aliased == E2BRootUser.ALIAS:
        return
    raise ConnectError(
        Code.PERMISSION_DENIED,
        f"user {name!r} is refused: every command and file here is the sandbox's "
        f"unprivileged user's ({SANDBOX_USER!r}, uid 1000)"
        + (
            "; an environment with e2b.root_user: alias (such as 'harbor') runs root's as that user"
            if name == ROOT_USER
            else ""
        ),
    )


def _message(model: type[BaseModel], raw: dict[str, Any]) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise ConnectError(Code.INVALID_ARGUMENT, f"bad message: {exc.errors()[0]['msg']}") from exc


def _timeout_s(request: Request) -> float | None:
    raw = request.headers.get("connect-timeout-ms", "")
    return int(raw) / 1000 if raw.isdigit() and int(raw) > 0 else None


# -- process.Process ---------------------------------------------------------------------------


@router.post("/process.Process/{method}")
async def process(method: str, request: Request, svc: Sandboxes) -> Response:
    body = await request.body()
    stream = method in ("Start", "Connect")
    try:
        raw = connect.read_envelope(body) if stream else connect.parse(body)
        rollout, e2b = await _sandbox(request, svc)
        if method == "Start":
            return await _start(request, svc, rollout, e2b, _message(StartRequest, raw))
        if method == "Connect":
            selector = _message(SelectorRequest, raw).process
            pid = await svc.find_process(rollout.rollout_id, selector.pid, selector.tag)
            record = await svc.process(rollout.rollout_id, pid)
            return _stream(_events(svc, rollout.rollout_id, record))
        if method == "List":
            return JSONResponse(
                {"processes": [_info(p) for p in await svc.processes(rollout.rollout_id)]}
            )
        if method in ("SendInput", "CloseStdin"):
            sent = _message(SendInputRequest, raw)
            pid = await svc.find_process(rollout.rollout_id, sent.process.pid, sent.process.tag)
            given = sent.input
            encoded = (given.stdin or given.pty or "") if given is not None else ""
            await svc.send_input(
                rollout, pid, base64.b64decode(encoded), close=method == "CloseStdin"
            )
            return JSONResponse({})
        if method == "Update":
            update = _message(UpdateRequest, raw)
            pid = await svc.find_process(rollout.rollout_id, update.process.pid, update.process.tag)
            if update.pty is not None:
                size = (update.pty.size.rows, update.pty.size.cols)
                await svc.send_input(rollout, pid, b"", resize=size)
            return JSONResponse({})
        if method == "SendSignal":
            signal = _message(SendSignalRequest, raw)
            pid = await svc.find_process(rollout.rollout_id, signal.process.pid, signal.process.tag)
            kill = signal.signal not in ("SIGNAL_SIGTERM", 15)
            if not await svc.signal(rollout, pid, kill=kill):
                raise ConnectError(Code.NOT_FOUND, f"process {pid} not found")
            return JSONResponse({})
        raise ConnectError(
            Code.UNIMPLEMENTED,
            f"process.Process/{method} is not supported here",
        )
    except ConnectError as exc:
        if stream:  # a stream's error is its end-of-stream message
            return _stream(_just(exc))
        return exc.response()
    except InfraError as exc:
        return _stream(_just(failed(exc))) if stream else failed(exc).response()
    except SandboxGone as exc:
        return _stream(_just(gone(exc))) if stream else gone(exc).response()


async def _start(
    request: Request, svc: E2BSandboxes, rollout: Rollout, e2b: E2BState, start: StartRequest
) -> Response:
    _user(svc, rollout, request)
    config = start.process
    started = await svc.start_process(
        rollout,
        e2b,
        [config.cmd, *config.args],
        envs=config.envs,
        cwd=config.cwd,
        timeout_s=_timeout_s(request),
        tag=start.tag,
        stdin=bool(start.stdin),
        pty=(start.pty.size.rows, start.pty.size.cols) if start.pty is not None else None,
    )
    return _stream(_events(svc, rollout.rollout_id, started))


def _stream(events: AsyncIterator[bytes]) -> StreamingResponse:
    # Exactly this content type: the SDK refuses a stream with any parameter on it.
    return StreamingResponse(events, media_type=connect.STREAM_CONTENT_TYPE)


async def _just(error: ConnectError) -> AsyncIterator[bytes]:
    yield connect.end_stream(error)


async def _events(svc: E2BSandboxes, rollout_id: str, process: Process) -> AsyncIterator[bytes]:
    """A command's stream: its start event at once (a background command's handle waits
    for it), its output as it is printed (state/streams.py), keepalives while it prints
    nothing, then its end. The command runs to its end whether or not this client stays:
    its result is the rollout's call result, so a client that reattaches (``Connect``)
    gets it, and its output from the start."""
    yield connect.envelope(process_event("start", {"pid": process.pid}))
    # Started before anything is awaited: a client gone right after the start event (a
    # background handle dropped) cancels this generator at its next await, and the
    # command must run all the same.
    running = asyncio.ensure_future(svc.run(rollout_id, process.pid))
    running.add_done_callback(_retrieve)
    pieces = svc.output(rollout_id, process.call_id, running.done)
    terminal = process.pty is not None
    streamed = {"stdout": bytearray(), "stderr": bytearray(), "pty": bytearray()}
    try:
        async for stream, data in _with_keepalives(pieces):
            if not stream:
                yield connect.envelope(process_event("keepalive", {}))
                continue
            streamed[stream] += data
            yield connect.envelope(process_event("data", {stream: _b64(data)}))
        reply = running.result()
    except InfraError as exc:
        yield connect.end_stream(failed(exc))
        return
    except SandboxGone as exc:
        yield connect.end_stream(gone(exc))
        return
    except ConnectError as exc:
        yield connect.end_stream(exc)
        return
    if reply.outcome != Outcome.OK and reply.error_kind != "timeout":
        # The arguments were refused (the agent_error of a model's call): no process ran.
        yield connect.end_stream(ConnectError(Code.INVALID_ARGUMENT, reply.output))
        return
    output = CommandOutput.model_validate_json(reply.output)
    kept: list[tuple[Literal["stdout", "stderr", "pty"], str]] = [
        ("pty" if terminal else "stdout", output.stdout),
        ("stderr", output.stderr),
    ]
    for name, text in kept:
        rest = _not_streamed(text, bytes(streamed[name]))
        if rest:
            yield connect.envelope(data_event(name, rest))
    if output.timed_out:
        yield connect.end_stream(
            ConnectError(Code.DEADLINE_EXCEEDED, "the command ran past its timeout and was killed")
        )
        return
    yield connect.envelope(process_event("end", _end(output)))
    yield connect.end_stream()


def _not_streamed(kept: str, streamed: bytes) -> str:
    """What the result says that its stream did not: all of it when nothing was streamed
    (a stream gone with its list's time), the notes after it (a limit the command hit),
    or, for output past the budget, the cut and the tail the result kept."""
    seen = streamed.decode("utf-8", "replace")
    if kept.startswith(seen):
        return kept[len(seen) :]
    cut = kept.find("\n[... ")
    return kept[cut:] if cut >= 0 else ""


async def _with_keepalives(pieces: Pieces) -> Pieces:
    """``pieces``, with ``("", b"")`` whenever none came for :data:`KEEPALIVE_S`."""
    iterator = pieces.__aiter__()
    waiting: asyncio.Future[tuple[str, bytes]] | None = None
    try:
        while True:
            if waiting is None:
                waiting = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({waiting}, timeout=KEEPALIVE_S)
            if not done:
                yield "", b""
                continue
            try:
                piece = waiting.result()
            except StopAsyncIteration:
                return
            waiting = None
            yield piece
    finally:
        if waiting is not None:
            waiting.cancel()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _end(output: CommandOutput) -> dict[str, Any]:
    """The ``EndEvent`` as envd reports it: ``exit status N``, or ``signal: killed``."""
    if output.exit_code is None or (output.signal is not None and output.exit_code > 128):
        status = "signal: killed" if output.signal in (None, 9) else f"signal: {output.signal}"
        return {"exitCode": -1, "status": status, "error": status}
    end: dict[str, Any] = {"exited": True, "status": f"exit status {output.exit_code}"}
    if output.exit_code:
        end["exitCode"] = output.exit_code
        end["error"] = f"exit status {output.exit_code}"
    return end


def _info(record: dict[str, Any]) -> dict[str, Any]:
    argv = record["argv"]
    info: dict[str, Any] = {
        "config": {"cmd": argv[0], "args": argv[1:], "envs": record["envs"], "cwd": record["cwd"]},
        "pid": record["pid"],
    }
    if record.get("tag"):
        info["tag"] = record["tag"]
    return info


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


# -- filesystem.Filesystem ---------------------------------------------------------------------


@router.post("/filesystem.Filesystem/{method}")
async def filesystem(method: str, request: Request, svc: Sandboxes) -> Response:
    stream = method == "WatchDir"
    try:
        body = await request.body()
        raw = connect.read_envelope(body) if stream else connect.parse(body)
        rollout, _ = await _sandbox(request, svc)
        _user(svc, rollout, request)
        if stream:
            watch = _message(WatchRequest, raw)
            watcher_id = await svc.watch(rollout, watch.path, watch.recursive)
            return _stream(_watching(svc, rollout, watcher_id))
        return JSONResponse(await _filesystem(svc, rollout, method, raw))
    except (ConnectError, InfraError, SandboxGone, FileProblem) as exc:
        error = _connect_error(exc)
        return _stream(_just(error)) if stream else error.response()


def _connect_error(exc: ConnectError | InfraError | SandboxGone | FileProblem) -> ConnectError:
    if isinstance(exc, InfraError):
        return failed(exc)
    if isinstance(exc, SandboxGone):
        return gone(exc)
    if isinstance(exc, FileProblem):
        return ConnectError(_FILE_CODES.get(exc.kind, Code.INVALID_ARGUMENT), exc.message)
    return exc


async def _watching(svc: E2BSandboxes, rollout: Rollout, watcher_id: str) -> AsyncIterator[bytes]:
    """``WatchDir`` (the async SDK's ``watch_dir``): its start, then what changes, looked
    for every :data:`WATCH_POLL_S` (E2BSandboxes.watched), keepalives between; over when
    the client goes, or the sandbox does."""
    yield connect.envelope({"start": {}})
    quiet_since = time.monotonic()
    try:
        while True:
            await asyncio.sleep(WATCH_POLL_S)
            events = await svc.watched(rollout, watcher_id)
            for event in events:
                yield connect.envelope({"filesystem": event})
            if events:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > KEEPALIVE_S:
                yield connect.envelope({"keepalive": {}})
                quiet_since = time.monotonic()
    except (ConnectError, InfraError, SandboxGone, FileProblem) as exc:
        yield connect.end_stream(_connect_error(exc))
    finally:
        await svc.unwatch(rollout, watcher_id)


async def _filesystem(
    svc: E2BSandboxes, rollout: Rollout, method: str, raw: dict[str, Any]
) -> dict[str, Any]:
    if method == "CreateWatcher":
        watch = _message(WatchRequest, raw)
        return {"watcherId": await svc.watch(rollout, watch.path, watch.recursive)}
    if method == "GetWatcherEvents":
        watcher = _message(WatcherRequest, raw)
        return {"events": await svc.watched(rollout, watcher.watcher_id)}
    if method == "RemoveWatcher":
        watcher = _message(WatcherRequest, raw)
        if not await svc.unwatch(rollout, watcher.watcher_id):
            raise ConnectError(Code.NOT_FOUND, f"watcher {watcher.watcher_id} not found")
        return {}
    if method == "Move":
        move = _message(MoveRequest, raw)
        moved = await svc.file_op(rollout, "move", move.source, target=move.destination)
        assert moved.entry is not None
        return {"entry": entry_json(moved.entry)}
    actions: dict[str, Callable[[PathRequest], Awaitable[dict[str, Any]]]] = {}

    async def stat(req: PathRequest) -> dict[str, Any]:
        found = await svc.file_op(rollout, "stat", req.path)
        assert found.entry is not None
        return {"entry": entry_json(found.entry)}

    async def listing(req: PathRequest) -> dict[str, Any]:
        found = await svc.file_op(rollout, "list", req.path, depth=max(1, req.depth))
        return {"entries": [entry_json(e) for e in found.entries]}

    async def make_dir(req: PathRequest) -> dict[str, Any]:
        made = await svc.file_op(rollout, "mkdir", req.path)
        if made.created is False:
            raise ConnectError(Code.ALREADY_EXISTS, f"directory {req.path} already exists")
        assert made.entry is not None
        return {"entry": entry_json(made.entry)}

    async def remove(req: PathRequest) -> dict[str, Any]:
        await svc.file_op(rollout, "remove", req.path)
        return {}

    actions = {"Stat": stat, "ListDir": listing, "MakeDir": make_dir, "Remove": remove}
    if method not in actions:
        raise ConnectError(
            Code.UNIMPLEMENTED, f"filesystem.Filesystem/{method} is not supported here"
        )
    return await actions[method](_message(PathRequest, raw))


# -- /files and /health ------------------------------------------------------------------------


def _file_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _file_failure(exc: FileProblem | ConnectError | InfraError) -> JSONResponse:
    """The file endpoints' answer to a refused or failed operation: a file problem by its
    kind, a refused request as 400 (an unreachable sandbox as 502), an infra failure 502."""
    if isinstance(exc, FileProblem):
        return _file_error(_FILE_STATUS.get(exc.kind, 400), exc.message)
    if isinstance(exc, ConnectError):
        status = {Code.UNAVAILABLE: 502, Code.RESOURCE_EXHAUSTED: 429}.get(exc.code, 400)
        return _file_error(status, exc.message)
    return _file_error(502, failed(exc).message)


@router.get("/files")
async def read_file(
    request: Request,
    svc: Sandboxes,
    path: str,
    username: Annotated[str | None, Query()] = None,
) -> Response:
    """``sandbox.files.read``: the file's bytes."""
    try:
        rollout, _ = await _sandbox(request, svc)
        _user(svc, rollout, request, username)
        found = await svc.file_op(rollout, "read", path)
    except (FileProblem, ConnectError, InfraError) as exc:
        return _file_failure(exc)
    return Response(found.data or b"", media_type="application/octet-stream")


@router.post("/files")
async def write_file(
    request: Request,
    svc: Sandboxes,
    path: str | None = None,
    username: Annotated[str | None, Query()] = None,
) -> Response:
    """``sandbox.files.write``: multipart (one part named ``file`` per file, its filename
    the path when no ``path`` is given) or the raw bytes (``application/octet-stream``)."""
    # The whole body is read before anything is refused: a server that answers while the
    # client is still sending leaves the client's transport to cope with an early response
    # (and a reset, if the socket closes with the rest unread). Once, on a loaded host, the
    # E2B SDK's pyqwest transport read a refused write's answer as "error reading a body
    # from connection"; answering early is the one way this handler differed from others.
    files: list[tuple[str, bytes]] = []
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        form = await request.form()
        for part in form.getlist("file"):
            if isinstance(part, str):
                continue
            target = path or part.filename or ""
            files.append((target, await part.read()))
    else:
        files.append((path or "", await request.body()))
    try:
        rollout, _ = await _sandbox(request, svc)
        _user(svc, rollout, request, username)
        written = []
        for target, data in files:
            if not target:
                return _file_error(400, "a file to write needs a path")
            made = await svc.file_op(rollout, "write", target, data=data)
            assert made.entry is not None
            written.append({"name": made.entry.name, "type": "file", "path": made.entry.path})
    except (FileProblem, ConnectError, InfraError) as exc:
        return _file_failure(exc)
    if not written:
        return _file_error(400, "no file in the request")
    return JSONResponse(written)


@router.get("/health")
async def health(request: Request, svc: Sandboxes) -> Response:
    """``sandbox.is_running()``: 204 while it lives; 502 "was not found" once it ended."""
    try:
        await _sandbox(request, svc)
    except ConnectError as exc:
        return _file_error(502, exc.message)
    return Response(status_code=204)
