"""The FastAPI application factory."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator import __version__
from orchestrator.api import agent_rft, errors, health, rollouts
from orchestrator.api.audit import AuditRecorder
from orchestrator.api.auth import (
    PRINCIPAL,
    AuthFailures,
    authenticate,
    e2b_sandbox,
    loggable_path,
)
from orchestrator.api.deps import AppState
from orchestrator.api.middleware import HttpMetrics
from orchestrator.config import Settings, get_settings
from orchestrator.e2b import control as e2b_control
from orchestrator.e2b import envd as e2b_envd
from orchestrator.e2b.sandboxes import E2BSandboxes
from orchestrator.environments.loader import load_environments
from orchestrator.grading import get_grader
from orchestrator.observability.logging import configure_logging, get_logger
from orchestrator.outcomes import Outcome
from orchestrator.rollouts.bounds import check_agent_rft_bound
from orchestrator.rollouts.service import RolloutService
from orchestrator.state.audit import AuditLog
from orchestrator.state.broker import make_celery
from orchestrator.state.collector import StateCollector
from orchestrator.state.records import RolloutStore
from orchestrator.state.replies import WorkerClient
from orchestrator.tenants import Principal, Tenants, TenantsError


class RequestGuard:
    """Before any route, in this order: an address locked out for guessing gets 429; the
    caller's credential, to its tenant (:func:`~orchestrator.api.auth.authenticate`; open
    paths need none), put in the scope for the routes; 413 for
    bodies over the limit, counted as they stream in (Content-Length may lie or be absent);
    every body read as JSON whatever its declared content type (clients that omit the
    header are common). After the route: any exception that escaped is a 503 JSON answer
    (our bug, never the agent's) and the connection stays usable."""

    def __init__(self, app: ASGIApp, settings: Settings, tenants: Tenants) -> None:
        self.app = app
        self.settings = settings
        self.tenants = tenants
        self.failures = AuthFailures(settings.auth_failures_max, settings.auth_failures_window_s)
        self.limit = settings.max_request_bytes
        self.file_limit = (settings.e2b_file_max_mb << 20) + (1 << 20)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        path = scope["path"]
        client = scope.get("client")
        address = client[0] if client else ""
        locked_s = self.failures.locked_for(address)
        if locked_s:
            # Refused whatever it presents: a right guess now would say so (docs/tenancy.md).
            await self._answer(
                send,
                path,
                429,
                "too_many_failed_authentications",
                "too many failed authentications from this address: try again later",
                {"Retry-After": str(math.ceil(locked_s))},
            )
            return
        verdict = authenticate(self.tenants, path, headers)
        if verdict is None:
            self.failures.failed(address)
            await self._answer(
                send,
                path,
                401,
                "unauthorized",
                "missing or wrong credentials (a bearer token; E2B: X-API-KEY, or the "
                "sandbox's X-Access-Token)",
                {"WWW-Authenticate": "Bearer"},
            )
            return
        if isinstance(verdict, Principal):
            scope.setdefault("state", {})[PRINCIPAL] = verdict
        # A file written through the E2B API is its own body, up to e2b_file_max_mb.
        limit = self.file_limit if path == "/files" else self.limit
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._answer(send, path, 413, "too_large", f"the body is over {limit} bytes")
            return
        # The E2B sandbox plane's bodies are multipart, octets or Connect envelopes.
        if (
            scope.get("method") in ("POST", "PUT", "PATCH")
            and not e2b_sandbox(path)
            and b"json" not in headers.get(b"content-type", b"")
        ):
            kept = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            # In place: the HTTP metrics around this read the matched route from the scope.
            scope["headers"] = [*kept, (b"content-type", b"application/json")]
        seen = 0
        started = False

        async def counting() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    # FastAPI lets an HTTPException out of body parsing as it is.
                    raise HTTPException(413, f"the body is over {limit} bytes")
            return message

        async def tracking(message: Message) -> None:
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting, tracking)
        except Exception as exc:
            get_logger(__name__).exception(
                "api.unexpected_error", path=loggable_path(scope["path"])
            )
            if started:
                raise
            await self._answer(
                send,
                path,
                503,
                "internal_error",
                f"{type(exc).__name__}: {exc}",
                {"Retry-After": errors.RETRY_AFTER_S},
                outcome=Outcome.INFRA_ERROR,
            )

    async def _answer(
        self,
        send: Send,
        path: str,
        status: int,
        code: str,
        message: str,
        headers: dict[str, str] | None = None,
        *,
        outcome: Outcome = Outcome.REJECTED,
    ) -> None:
        response = errors.error_response(status, outcome, code, message, headers=headers, path=path)
        await response({"type": "http"}, _empty_receive, send)


async def _empty_receive() -> Message:
    return {"type": "http.disconnect"}


ROUTERS: tuple[APIRouter, ...] = (
    agent_rft.router,
    health.router,
    agent_rft.secret_grader,
    rollouts.router,
    e2b_control.router,
    e2b_envd.router,
)
"""Every route of the API (tests/e2e/test_tenancy.py tries each across tenants). Matched
in this order: the tool calls' first, since every request pays for the routes tried
before its own (E2B's planes hold dozens)."""


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    configure_logging(settings)
    if not settings.tokens and settings.tenants_file is None:
        raise RuntimeError("no API tokens configured: set ORCH_API_TOKENS or ORCH_TENANTS_FILE")
    try:  # a tenants file that cannot be read fails the start (docs/tenancy.md)
        tenants = Tenants(settings.tokens, settings.grader_url_secret, settings.tenants_file)
    except TenantsError as exc:
        raise RuntimeError(str(exc)) from None
    # Every path of an Agent RFT call must answer within the platform's bound.
    check_agent_rft_bound(settings)
    environments = load_environments(settings)
    # A misconfigured grader fails the start, not the first grade of a training run.
    for name in environments.names():
        config = environments.get(name).grader
        grader = get_grader(config.name, config.options)
        if grader.sandbox_time_s() and settings.sandbox_backend != "docker":
            # Only the Docker backend keeps an image's pristine /workspace on the host.
            raise RuntimeError(
                f"environment {name!r}: grader {config.name!r} runs tests in the sandbox, "
                f"which needs ORCH_SANDBOX_BACKEND=docker (this deployment runs "
                f"{settings.sandbox_backend})"
            )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = RolloutStore.connect(settings)
        queue = WorkerClient(settings, make_celery(settings), store)
        rollouts = RolloutService(settings, store, environments, queue)
        audit = AuditRecorder(AuditLog(store.redis, store.keys), tenants)
        app.state.orchestrator = AppState(
            settings=settings,
            store=store,
            queue=queue,
            service=rollouts,
            e2b=E2BSandboxes(rollouts, tenants),
            tenants=tenants,
            audit=audit,
        )
        await audit.environments(environments)
        # The deployment's state gauges, read from Redis at each scrape of /metrics.
        app.state.metrics_state = StateCollector(settings, environments)
        # uvicorn runs its loop with debug off whatever PYTHONASYNCIODEBUG says.
        loop = asyncio.get_running_loop()
        if settings.asyncio_debug:
            loop.set_debug(True)
            loop.slow_callback_duration = settings.asyncio_slow_callback_s
        # Said here, so a log without slow-callback lines proves something
        # (tests/e2e/test_event_loop.py).
        get_logger(__name__).info("api.started", asyncio_debug=loop.get_debug())
        try:
            async with contextlib.AsyncExitStack() as listeners:
                if settings.api_metrics_port:
                    await listeners.enter_async_context(health.metrics_listener(app, settings))
                yield
        finally:
            app.state.metrics_state.close()
            await audit.close()
            await rollouts.calls.aclose()
            await store.close()

    app = FastAPI(
        title="Sandboxed rollout orchestrator",
        version=__version__,
        description="Tool and grader endpoints for agent RL trainers; a sandbox per rollout.",
        lifespan=lifespan,
    )
    errors.install(app)
    for router in ROUTERS:
        app.include_router(router)
    app.add_middleware(RequestGuard, settings=settings, tenants=tenants)
    app.add_middleware(HttpMetrics)  # outermost: it counts the guard's refusals too
    return app
