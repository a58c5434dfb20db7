"""Bearer-token auth: tokens from settings, compared in constant time.

Checked twice on purpose: by :class:`~orchestrator.api.app.RequestGuard` before the body is
read (an unauthenticated caller learns nothing about its body), and by the routes'
dependency, which also puts the scheme into the OpenAPI document.
"""

from __future__ import annotations

import secrets

from fastapi import HTTPException, Request

from orchestrator.api.deps import state

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/docs", "/redoc", "/openapi.json"})


def token_ok(tokens: list[str], authorization: str) -> bool:
    scheme, _, presented = authorization.partition(" ")
    ok = False
    if scheme.lower() == "bearer" and presented:
        # Compare against every token so the time taken does not reveal which matched.
        for token in tokens:
            ok |= secrets.compare_digest(presented.encode(), token.encode())
    return ok


async def require_token(request: Request) -> None:
    if not token_ok(state(request).settings.tokens, request.headers.get("authorization", "")):
        raise HTTPException(
            401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
        )
