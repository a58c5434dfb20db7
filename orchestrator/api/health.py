"""Health endpoints: liveness and readiness (open, no token), and for the operator's
tokens readiness's reasons and the metrics."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request as StarletteRequest
from starlette.routing import Route

from orchestrator.api.auth import require_admin
from orchestrator.api.deps import state
from orchestrator.api.models import ErrorResponse
from orchestrator.config import Settings
from orchestrator.observability.metrics import exposition

router = APIRouter(tags=["health"])
OPERATORS_ONLY: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse, "description": "Missing or wrong bearer token."},
    404: {"model": ErrorResponse, "description": "A tenant's token: the operator's route."},
}


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    responses={503: {"description": "Not ready: Redis down or no schedulable host."}},
)
async def readyz(request: Request) -> JSONResponse:
    """Ready when Redis answers and at least one worker host is schedulable. Open, so it
    says no more than a load balancer needs; ``GET /v1/readiness`` (the operator's
    tokens) says why."""
    ready = bool((await _readiness(request))["ready"])
    return JSONResponse({"ready": ready}, status_code=200 if ready else 503)


@router.get(
    "/v1/readiness",
    dependencies=[Depends(require_admin)],
    responses={
        **OPERATORS_ONLY,
        503: {"description": "Not ready: Redis down or no schedulable host."},
    },
)
async def readiness(request: Request) -> JSONResponse:
    """``/readyz`` with its reasons, for the operator: Redis, and each host's heartbeat
    (alive, its daemon answering, disk and capacity to spare, not draining) with why it
    is cordoned, if it is."""
    found = await _readiness(request)
    return JSONResponse(found, status_code=200 if found["ready"] else 503)


async def _readiness(request: Request) -> dict[str, Any]:
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
    return {"ready": bool(checks["redis"] and checks["schedulable_hosts"]), "checks": checks}


@router.get(
    "/metrics",
    dependencies=[Depends(require_admin)],
    response_class=Response,
    responses={
        **OPERATORS_ONLY,
        200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text."},
    },
)
async def metrics(request: Request) -> Response:
    """Counters of every API process and the deployment's state gauges (docs/metrics.md):
    for the operator's tokens; a scraper reads them on ``api_metrics_port`` instead."""
    return await _exposition(request.app)


async def _exposition(app: Starlette) -> Response:
    collector = getattr(app.state, "metrics_state", None)
    extra = [collector] if collector is not None else []
    # Reading the other processes' files and Redis blocks: off the event loop.
    body = await asyncio.to_thread(exposition, *extra)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@asynccontextmanager
async def metrics_listener(api: Starlette, settings: Settings) -> AsyncIterator[None]:
    """The scraper's own listener (``api_metrics_port``) for as long as the block runs:
    ``/metrics`` and nothing else, no token. Every API process binds it with SO_REUSEPORT,
    so whichever answers renders every process's counters (multiprocess mode) and the
    state gauges."""

    async def scrape(_: StarletteRequest) -> Response:
        return await _exposition(api)

    app = Starlette(routes=[Route("/metrics", scrape)])
    family = socket.AF_INET6 if ":" in settings.api_metrics_host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((settings.api_metrics_host, settings.api_metrics_port))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off"))
    # Served on the API's own loop; not server.serve(), which would take the process's
    # signal handlers from the API's server.
    serving = asyncio.create_task(server._serve(sockets=[sock]))
    try:
        yield
    finally:
        server.should_exit = True
        await serving
        sock.close()
