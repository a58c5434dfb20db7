"""Bearer-token auth: tokens from settings, compared in constant time.

Checked twice on purpose: by :class:`~orchestrator.api.app.RequestGuard` before the body is
read (an unauthenticated caller learns nothing about its body), and by the routes'
dependency, which also puts the scheme into the OpenAPI document.
"""

from __future__ import annotations

import secrets

from fastapi import HTTPException, Request

from orchestrator.api.deps import state
from orchestrator.config import Settings

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/docs", "/redoc", "/openapi.json"})
HEADERLESS_GRADE_PREFIX = "/agent-rft/grade/"
"""The endpoint grader under a secret path segment (``grader_url_secret``): no header."""


def token_ok(tokens: list[str], authorization: str) -> bool:
    scheme, _, presented = authorization.partition(" ")
    ok = False
    if scheme.lower() == "bearer" and presented:
        # Compare against every token so the time taken does not reveal which matched.
        for token in tokens:
            ok |= secrets.compare_digest(presented.encode(), token.encode())
    return ok


def secret_ok(secret: str, path: str) -> bool:
    """Whether ``path`` is the endpoint grader under the deployment's secret segment."""
    if not secret or not path.startswith(HEADERLESS_GRADE_PREFIX):
        return False
    presented = path.removeprefix(HEADERLESS_GRADE_PREFIX)
    return secrets.compare_digest(presented.encode(), secret.encode())


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


def request_allowed(settings: Settings, path: str, headers: dict[bytes, bytes]) -> bool:
    """The one rule of who may make a request: an open path, the grader's secret path,
    a valid bearer token; on the E2B planes, the SDK's own credentials."""
    if path in OPEN_PATHS or secret_ok(settings.grader_url_secret, path):
        return True
    if e2b_control(path):
        key = headers.get(b"x-api-key", b"").decode("latin-1")
        return bool(key) and token_ok(settings.tokens, f"Bearer {key}")
    if e2b_sandbox(path):
        return b"e2b-sandbox-id" in headers and b"x-access-token" in headers
    return token_ok(settings.tokens, headers.get(b"authorization", b"").decode("latin-1"))


async def require_secret(request: Request) -> None:
    """The secret grader route's own check (the guard's too: checked twice, as tokens)."""
    if not secret_ok(state(request).settings.grader_url_secret, request.url.path):
        raise HTTPException(404, "Not Found")


async def require_token(request: Request) -> None:
    if not token_ok(state(request).settings.tokens, request.headers.get("authorization", "")):
        raise HTTPException(
            401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
        )
