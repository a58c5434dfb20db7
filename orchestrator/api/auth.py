"""Who may make a request, and for which tenant (docs/tenancy.md).

:class:`~orchestrator.api.app.RequestGuard` decides before the body is read (an
unauthenticated caller learns nothing about its body) and puts the caller's
:class:`~orchestrator.tenants.Principal` in the request's scope; the routes' dependency
(:func:`caller`) reads it from there, and puts the scheme into the OpenAPI document.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from enum import Enum
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from orchestrator.tenants import Principal, Tenants

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/docs", "/redoc", "/openapi.json"})
HEADERLESS_GRADE_PREFIX = "/agent-rft/grade/"
"""The endpoint grader under a secret path segment (``grader_url_secret``): no header."""
PRINCIPAL = "principal"
"""The key of the caller's :class:`Principal` in the request scope's ``state``."""


def bearer(authorization: str) -> str:
    """The token of an ``Authorization: Bearer <token>`` header ("" when there is none)."""
    scheme, _, presented = authorization.partition(" ")
    return presented.strip() if scheme.lower() == "bearer" else ""


def loggable_path(path: str) -> str:
    """``path`` fit for a log line: the grader's secret segment masked."""
    if path.startswith(HEADERLESS_GRADE_PREFIX):
        return HEADERLESS_GRADE_PREFIX + "<secret>"
    return path


E2B_CONTROL_PREFIXES = ("/sandboxes", "/v2/sandboxes", "/snapshots", "/templates")
"""The E2B control plane (docs/e2b.md): the SDK authenticates with ``X-API-KEY``. (Its
snapshots are deleted as templates: ``DELETE /templates/{id}``.)"""
E2B_SANDBOX_PATHS = ("/health", "/files", "/process.Process/", "/filesystem.Filesystem/")
"""The E2B sandbox plane: each request names its sandbox (``E2b-Sandbox-Id``) and carries
that sandbox's access token (``X-Access-Token``), which its route checks against the
sandbox's record."""


def e2b_control(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in E2B_CONTROL_PREFIXES)


def e2b_sandbox(path: str) -> bool:
    return path in ("/health", "/files") or path.startswith(E2B_SANDBOX_PATHS[2:])


class Open(Enum):
    """A request :func:`authenticate` lets through with no caller: an open path, or one
    whose route checks a credential of its own (the E2B sandbox plane's access token)."""

    PATH = "open"


def authenticate(
    tenants: Tenants, path: str, headers: dict[bytes, bytes]
) -> Principal | Open | None:
    """The one rule of who may make a request: an open path; the grader's secret path; a
    bearer token; on the E2B planes, the SDK's own credentials. None: refused."""
    if path in OPEN_PATHS:
        return Open.PATH
    if path.startswith(HEADERLESS_GRADE_PREFIX) and "/" not in path.removeprefix(
        HEADERLESS_GRADE_PREFIX
    ):
        return tenants.by_grader_secret(path.removeprefix(HEADERLESS_GRADE_PREFIX))
    if e2b_control(path):
        return tenants.by_token(headers.get(b"x-api-key", b"").decode("latin-1").strip())
    if e2b_sandbox(path):
        named = b"e2b-sandbox-id" in headers and b"x-access-token" in headers
        return Open.PATH if named else None
    return tenants.by_token(bearer(headers.get(b"authorization", b"").decode("latin-1")))


class AuthFailures:
    """Failed authentications per client address, in a fixed window: past ``limit`` in
    one, the address is refused (429) until the window ends, whatever it presents, so a
    guess that happens to be right is refused too and brute force learns nothing. Kept
    per process, bounded (the oldest addresses are forgotten first)."""

    MAX_ADDRESSES = 10_000

    def __init__(self, limit: int, window_s: float) -> None:
        self.limit = limit
        self.window_s = window_s
        self._seen: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def locked_for(self, address: str) -> float:
        """Seconds until ``address`` may try again (0: it may now)."""
        started, failures = self._seen.get(address, (0.0, 0))
        left = started + self.window_s - time.monotonic()
        return left if failures >= self.limit and left > 0 else 0.0

    def failed(self, address: str) -> None:
        now = time.monotonic()
        started, failures = self._seen.pop(address, (now, 0))
        if now - started >= self.window_s:
            started, failures = now, 0
        self._seen[address] = (started, failures + 1)
        while len(self._seen) > self.MAX_ADDRESSES:
            self._seen.popitem(last=False)


def authenticated(request: Request) -> Principal | None:
    """The caller the guard put in the request's scope; None: none (an open path)."""
    found = request.scope.get("state", {}).get(PRINCIPAL)
    return found if isinstance(found, Principal) else None


def caller(request: Request) -> Principal:
    """The caller the guard authenticated (a route's dependency: async-free, a dict read)."""
    found = authenticated(request)
    if found is None:
        raise HTTPException(
            401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
        )
    return found


async def require_token(request: Request) -> None:
    """A router's dependency: the request has a caller (and OpenAPI shows the scheme)."""
    caller(request)


async def require_admin(request: Request) -> None:
    """A route only the operator's tokens may use: any other caller gets a 404."""
    if not caller(request).admin:
        raise HTTPException(404, "Not Found")


async def require_secret(request: Request) -> None:
    """The secret grader route's own check (the guard's too): a 404 without a caller."""
    if authenticated(request) is None:
        raise HTTPException(404, "Not Found")


async def _caller(request: Request) -> Principal:
    return caller(request)


Caller = Annotated[Principal, Depends(_caller)]
"""A route's parameter: who is calling (async: no thread hop, bench/profile.py)."""
