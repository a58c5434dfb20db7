"""The app's shared state, reached from a request."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from orchestrator.api.audit import AuditRecorder
from orchestrator.config import Settings
from orchestrator.e2b.sandboxes import E2BSandboxes
from orchestrator.rollouts.service import RolloutService
from orchestrator.state.records import RolloutStore
from orchestrator.state.replies import WorkerClient
from orchestrator.tenants import Tenants


@dataclass
class AppState:
    settings: Settings
    store: RolloutStore
    queue: WorkerClient
    service: RolloutService
    e2b: E2BSandboxes
    tenants: Tenants
    audit: AuditRecorder


def state(request: Request) -> AppState:
    app_state: AppState = request.app.state.orchestrator
    return app_state


async def audit_recorder(request: Request) -> AuditRecorder:
    """The process's audit recorder, as a dependency (async: no thread hop)."""
    return state(request).audit


async def service(request: Request) -> RolloutService:
    """The service, as a dependency. Async: FastAPI runs a plain ``def`` dependency in its
    thread pool, a thread hop per request for an attribute read (bench/profile.py showed
    the pool's locks in every call)."""
    return state(request).service
