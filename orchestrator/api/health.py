"""Health endpoints (open, no token): liveness, readiness, metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from orchestrator.api.deps import state

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Ready when Redis answers and at least one worker host reports a working daemon."""
    app = state(request)
    checks: dict[str, Any] = {}
    try:
        checks["redis"] = await app.store.ping()
    except Exception as exc:  # noqa: BLE001 - readiness reports any failure
        checks["redis"] = False
        checks["redis_error"] = str(exc)
    hosts = await app.queue.live_hosts() if checks["redis"] else []
    checks["hosts"] = hosts
    checks["workers"] = len(hosts)
    checks["docker"] = any(h.get("docker_ok") for h in hosts)
    ready = bool(checks["redis"] and checks["docker"])
    return JSONResponse({"ready": ready, "checks": checks}, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
