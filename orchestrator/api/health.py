"""Health endpoints (open, no token): liveness, readiness, metrics."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from orchestrator.api.deps import state
from orchestrator.observability.metrics import exposition

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    responses={503: {"description": "Not ready: Redis down or no schedulable host."}},
)
async def readyz(request: Request) -> JSONResponse:
    """Ready when Redis answers and at least one worker host is schedulable (alive, its
    daemon answering, disk and capacity to spare, not draining). Each host's heartbeat is
    shown with why it is cordoned, if it is."""
    app = state(request)
    checks: dict[str, Any] = {}
    try:
        checks["redis"] = await app.store.ping()
    except Exception as exc:  # noqa: BLE001 - readiness reports any failure
        checks["redis"] = False
        checks["redis_error"] = str(exc)
    hosts = await app.queue.heartbeats.live() if checks["redis"] else []
    checks["hosts"] = [beat.model_dump(mode="json") for beat in hosts]
    checks["workers"] = len(hosts)
    checks["docker"] = any(beat.backend_ok for beat in hosts)
    checks["schedulable_hosts"] = sorted(beat.host for beat in hosts if beat.schedulable)
    checks["cordoned_hosts"] = {
        beat.host: beat.cordon_reasons for beat in hosts if not beat.schedulable
    }
    ready = bool(checks["redis"] and checks["schedulable_hosts"])
    return JSONResponse({"ready": ready, "checks": checks}, status_code=200 if ready else 503)


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text."}},
)
async def metrics(request: Request) -> Response:
    """Counters of every API process and the deployment's state gauges (docs/metrics.md)."""
    collector = getattr(request.app.state, "metrics_state", None)
    extra = [collector] if collector is not None else []
    # Reading the other processes' files and Redis blocks: off the event loop.
    body = await asyncio.to_thread(exposition, *extra)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
