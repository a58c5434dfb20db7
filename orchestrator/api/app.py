"""The FastAPI application factory."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator import __version__
from orchestrator.api import agent_rft, errors, health, rollouts
from orchestrator.api.deps import AppState
from orchestrator.config import Settings, get_settings
from orchestrator.environments.loader import load_environments
from orchestrator.grading import get_grader
from orchestrator.observability.logging import configure_logging
from orchestrator.outcomes import Outcome
from orchestrator.queue.app import make_celery
from orchestrator.queue.client import QueueClient
from orchestrator.rollouts.service import RolloutService
from orchestrator.rollouts.store import RolloutStore


class RequestGuard:
    """Before any route: 413 for bodies over the limit, counted as they stream in
    (Content-Length may lie or be absent); and every body is JSON, whatever its declared
    content type (clients that omit the header are common)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large(send)
            return
        if scope.get("method") in ("POST", "PUT", "PATCH") and b"json" not in headers.get(
            b"content-type", b""
        ):
            kept = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*kept, (b"content-type", b"application/json")]}
        seen = 0

        async def counting() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, counting, send)
        except _TooLarge:
            await self._too_large(send)

    async def _too_large(self, send: Send) -> None:
        response = errors.error_response(
            413, Outcome.REJECTED, "too_large", f"the body is over {self.limit} bytes"
        )
        await response({"type": "http"}, _empty_receive, send)


class _TooLarge(Exception):
    pass


async def _empty_receive() -> Message:
    return {"type": "http.disconnect"}


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    configure_logging(settings)
    if not settings.tokens:
        raise RuntimeError("no API tokens configured: set ORCH_API_TOKENS")
    environments = load_environments(settings)
    # A misconfigured grader fails the start, not the first grade of a training run.
    for name in environments.names():
        grader = environments.get(name).grader
        get_grader(grader.name, grader.options)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = RolloutStore(settings.redis_url, settings.key_prefix)
        queue = QueueClient(settings, make_celery(settings), store.redis)
        app.state.orchestrator = AppState(
            settings=settings,
            store=store,
            queue=queue,
            service=RolloutService(settings, store, environments, queue),
        )
        try:
            yield
        finally:
            await store.close()

    app = FastAPI(
        title="Sandboxed rollout orchestrator",
        version=__version__,
        description="Tool and grader endpoints for agent RL trainers; a sandbox per rollout.",
        lifespan=lifespan,
    )
    errors.install(app)
    app.include_router(health.router)
    app.include_router(agent_rft.router)
    app.include_router(rollouts.router)
    app.add_middleware(RequestGuard, limit=settings.max_request_bytes)
    return app
