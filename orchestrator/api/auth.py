"""Bearer-token auth: tokens from settings, compared in constant time."""

from __future__ import annotations

import secrets

from fastapi import HTTPException, Request

from orchestrator.api.deps import state


async def require_token(request: Request) -> None:
    header = request.headers.get("authorization", "")
    scheme, _, presented = header.partition(" ")
    ok = False
    if scheme.lower() == "bearer" and presented:
        # Compare against every token so the time taken does not reveal which matched.
        for token in state(request).settings.tokens:
            ok |= secrets.compare_digest(presented.encode(), token.encode())
    if not ok:
        raise HTTPException(
            401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
        )
