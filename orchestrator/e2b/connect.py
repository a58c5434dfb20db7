"""The Connect RPC protocol, as the E2B SDK speaks it to a sandbox (docs/e2b.md): JSON codec,
HTTP POST, unary calls as bare JSON bodies, server streams as 5-byte envelopes.

- A unary answer is ``200 application/json`` and the message; an error is a non-200 with
  ``application/json`` ``{"code": "<connect code>", "message": ...}``.
- A stream answer is ``200`` with the content type exactly ``application/connect+json``
  (the SDK accepts no parameter on it), a sequence of envelopes (flags byte, 4-byte
  big-endian length, JSON message), and an end-of-stream envelope (flag 0x02) holding
  ``{}`` or ``{"error": {...}}``.
- A stream request carries one envelope (server streaming): :func:`read_envelope`.
"""

from __future__ import annotations

import json
import struct
from enum import StrEnum
from typing import Any

from fastapi.responses import JSONResponse

STREAM_CONTENT_TYPE = "application/connect+json"
END_STREAM = 0x02
_PREFIX = struct.Struct(">BI")


class Code(StrEnum):
    """The Connect error codes the E2B SDK maps to its exceptions."""

    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    PERMISSION_DENIED = "permission_denied"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    FAILED_PRECONDITION = "failed_precondition"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    UNIMPLEMENTED = "unimplemented"
    INTERNAL = "internal"
    UNAVAILABLE = "unavailable"
    UNAUTHENTICATED = "unauthenticated"


# The HTTP status of a unary error with each code (Connect's own table).
_STATUS = {
    Code.INVALID_ARGUMENT: 400,
    Code.NOT_FOUND: 404,
    Code.ALREADY_EXISTS: 409,
    Code.PERMISSION_DENIED: 403,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.FAILED_PRECONDITION: 400,
    Code.DEADLINE_EXCEEDED: 504,
    Code.UNIMPLEMENTED: 501,
    Code.INTERNAL: 500,
    Code.UNAVAILABLE: 503,
    Code.UNAUTHENTICATED: 401,
}


class ConnectError(Exception):
    """An RPC's error, as the SDK will read it (its code picks the exception)."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def wire(self) -> dict[str, str]:
        return {"code": self.code.value, "message": self.message}

    def response(self) -> JSONResponse:
        """The unary answer carrying this error."""
        return JSONResponse(self.wire(), status_code=_STATUS[self.code])


def envelope(message: dict[str, Any], *, flags: int = 0) -> bytes:
    """One message of a stream."""
    data = json.dumps(message, separators=(",", ":")).encode()
    return _PREFIX.pack(flags, len(data)) + data


def end_stream(error: ConnectError | None = None) -> bytes:
    """The stream's last envelope: success, or the error the call ends with."""
    return envelope({"error": error.wire()} if error else {}, flags=END_STREAM)


def read_envelope(body: bytes) -> dict[str, Any]:
    """The one message of a server-streaming request's body."""
    if len(body) < _PREFIX.size:
        raise ConnectError(Code.INVALID_ARGUMENT, "the request holds no message")
    flags, size = _PREFIX.unpack_from(body)
    if flags & 0x01:
        raise ConnectError(Code.UNIMPLEMENTED, "compressed messages are not supported")
    return parse(body[_PREFIX.size : _PREFIX.size + size])


def parse(data: bytes) -> dict[str, Any]:
    """A message's JSON; an invalid one is the caller's error."""
    try:
        message = json.loads(data or b"{}")
    except ValueError as exc:
        raise ConnectError(Code.INVALID_ARGUMENT, f"the message is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ConnectError(Code.INVALID_ARGUMENT, "the message is not a JSON object")
    return message
