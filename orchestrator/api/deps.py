"""The app's shared state, reached from a request."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from orchestrator.config import Settings
from orchestrator.e2b.sandboxes import E2BSandboxes
from orchestrator.rollouts.service import RolloutService
from orchestrator.state.records import RolloutStore
from orchestrator.state.replies import QueueClient


@dataclass
class AppState:
    settings: Settings
    store: RolloutStore
    queue: QueueClient
    service: RolloutService
    e2b: E2BSandboxes


def state(request: Request) -> AppState:
    app_state: AppState = request.app.state.orchestrator
    return app_state


def service(request: Request) -> RolloutService:
    return state(request).service
