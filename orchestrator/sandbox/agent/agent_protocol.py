"""The exec agent's wire, shared by both ends: the host's client (sandbox/agent/client.py)
imports it as ``orchestrator.sandbox.agent.agent_protocol``, the agent in a sandbox as
``agent_protocol``, the file beside its own (bind-mounted on Docker, a key of the pod's
Secret on Kubernetes). Standard library only, and no syntax newer than Python 3.8's outside
annotations (which are never evaluated): a codebase image brings its own Python.

One connection per request: the request as one JSON line (with ``token`` over TCP), then
the reply as one JSON line, ``{"ok": true, "result": {...}}`` or ``{"ok": false, "kind":
<Refusal>, "error": <message>}``. A streamed exec sends its output first, a line
``{"chunk": [<stream>, <base64>]}`` per piece. A result may itself carry the operation's
own failure as ``{"error": {"kind": <FileErrorKind or "internal">, "message": ...}}``
(files, read_file) or ``{"found": true, "error": <message>}`` (input).
"""

from __future__ import annotations

import base64
import json

TYPE_CHECKING = False  # (typing is not imported at run time: a sandbox's start pays for it)
if TYPE_CHECKING:
    from typing import Any


VERSION = 3
"""What a ping answers: 3 since refusals carry their ``kind``."""


class Op:
    """What a request asks the agent to do (its ``op``)."""

    PING = "ping"
    EXEC = "exec"
    READ_FILE = "read_file"
    SIGNAL = "signal"
    INPUT = "input"
    FILES = "files"
    MANIFEST = "manifest"
    SCRUB = "scrub"
    STAGE = "stage"
    PACK = "pack"
    UNPACK = "unpack"


class Refusal:
    """Why a request got no result (a reply's ``kind`` when ``ok`` is false)."""

    UNAUTHORIZED = "unauthorized"
    """No token, or the wrong one (TCP): the caller's configuration, never the sandbox's."""
    FAILED = "failed"
    """The agent could not carry the request out (a bad request, or its own failure)."""


INTERNAL = "internal"
"""A file operation's ``error.kind`` when it failed inside the agent, not for its path."""


# -- requests (the host's side) -------------------------------------------------------------


def ping() -> dict[str, Any]:
    return {"op": Op.PING}


def exec_request(
    command: str | list[str],
    timeout_s: float,
    budget: int,
    cwd: str,
    env: dict[str, str] | None = None,
    exec_id: str | None = None,
    stream: bool = False,
    stdin: bool = False,
    pty: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """A shell command line (str), or an argv run without any shell parsing (list);
    ``stream``: its output sent as it is printed, before the reply; ``stdin``: its input a
    pipe an ``input`` request writes; ``pty``: (rows, cols) of a pseudo-terminal it runs on
    (its input and output: the output stream is named "pty")."""
    request: dict[str, Any] = {"op": Op.EXEC, "timeout_s": timeout_s, "budget": budget, "cwd": cwd}
    if stream:
        request["stream"] = True
    if stdin:
        request["stdin"] = True
    if pty is not None:
        request["pty"] = {"rows": pty[0], "cols": pty[1]}
    request["argv" if isinstance(command, list) else "command"] = command
    if env:
        request["env"] = env
    if exec_id is not None:
        request["exec_id"] = exec_id
    return request


def read_file_request(
    path: str, start_line: int, end_line: int | None, max_bytes: int
) -> dict[str, Any]:
    return {
        "op": Op.READ_FILE,
        "path": path,
        "start_line": start_line,
        "end_line": end_line,
        "max_bytes": max_bytes,
    }


def input_request(
    exec_id: str, data: bytes, *, close: bool, resize: tuple[int, int] | None
) -> dict[str, Any]:
    """Write ``data`` to a running command's input (close it after, with ``close``), or set
    its terminal's size."""
    request: dict[str, Any] = {"op": Op.INPUT, "exec_id": exec_id, "close": close}
    if data:
        request["data"] = base64.b64encode(data).decode()
    if resize is not None:
        request["resize"] = list(resize)
    return request


def signal_request(exec_id: str, *, kill: bool) -> dict[str, Any]:
    return {"op": Op.SIGNAL, "exec_id": exec_id, "signal": "kill" if kill else "term"}


def files_request(
    action: str,
    path: str,
    *,
    target: str | None = None,
    depth: int = 1,
    data: bytes | None = None,
    max_bytes: int = 0,
) -> dict[str, Any]:
    request: dict[str, Any] = {"op": Op.FILES, "action": action, "path": path}
    if target is not None:
        request["target"] = target
    if action == "list":
        request["depth"] = depth
    if data is not None:
        request["data"] = base64.b64encode(data).decode()
    if action == "read":
        request["max_bytes"] = max_bytes
    return request


def stage_request(
    *,
    purge: list[str],
    keep: list[str],
    remove: list[str],
    write: dict[str, bytes],
    timeout_s: float,
) -> dict[str, Any]:
    return {
        "op": Op.STAGE,
        "purge": purge,
        "keep": keep,
        "remove": remove,
        "write": {path: base64.b64encode(data).decode() for path, data in write.items()},
        "timeout_s": timeout_s,
    }


def manifest_request() -> dict[str, Any]:
    return {"op": Op.MANIFEST}


def scrub_request(modes: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    return {"op": Op.SCRUB, "modes": modes, "timeout_s": timeout_s}


def pack_request(to: str) -> dict[str, Any]:
    return {"op": Op.PACK, "to": to}


def unpack_request(path: str) -> dict[str, Any]:
    return {"op": Op.UNPACK, "path": path}


# -- replies (the agent's side) -------------------------------------------------------------


def ok(result: object) -> bytes:
    return _line({"ok": True, "result": result})


def refused(kind: str, message: str) -> bytes:
    return _line({"ok": False, "kind": kind, "error": message})


def chunk(stream: str, data: bytes) -> bytes:
    return _line({"chunk": [stream, base64.b64encode(data).decode()]})


CHUNK_PREFIX = b'{"chunk"'
"""How a streamed piece's line starts (the reply's never does)."""


def file_error(kind: str, message: str) -> dict[str, object]:
    """A file operation's result when it failed for its path (``kind``: a FileErrorKind)
    or inside the agent (:data:`INTERNAL`)."""
    return {"error": {"kind": kind, "message": message}}


def _line(message: dict[str, object]) -> bytes:
    return json.dumps(message).encode() + b"\n"
