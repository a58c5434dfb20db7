"""The records a rollout leaves in Redis: its state and its trajectory."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

from orchestrator.outcomes import Outcome


class RolloutSource(StrEnum):
    """Which API a rollout came through."""

    AGENT_RFT = "agent_rft"
    """Agent RFT's tool and grader endpoints: the first call of a trace starts it."""
    API = "api"
    """The rollout API (``/v1/rollouts``): an explicit create."""
    E2B = "e2b"
    """The E2B-compatible API (docs/e2b.md): a sandbox its client drives itself."""
    SETUP = "setup"
    """A group's set-up step (docs/snapshots.md): its sandbox runs the environment's
    ``setup``, is snapshotted for the group's rollouts, and closes; never graded."""
    RECOVERED = "recovered"
    """Not a rollout anyone started: the record a worker writes for a sandbox of its host
    whose rollout Redis no longer knows (Redis lost its state), failed with cause
    ``state_lost``, so the trainer's next call or grade is a 503, never a fresh start."""


class RolloutState(StrEnum):
    """Where a rollout is in its life. ``infra_failed`` is final: never graded."""

    CREATING = "creating"
    ACTIVE = "active"
    PAUSED = "paused"
    """Its sandbox is kept as a snapshot (E2B ``pause``; docs/snapshots.md): it holds no
    slot, no CPU and no memory; its client's next request makes its sandbox again."""
    GRADED = "graded"
    INFRA_FAILED = "infra_failed"
    CLOSED = "closed"


class TrajectoryStep(BaseModel):
    """One tool call as the agent saw it, in the order the calls were made."""

    seq: int = Field(description="1-based order of the call within its rollout.")
    call_id: str
    tool: str
    arguments: Any = Field(description="As sent: a JSON string or an object.")
    outcome: Outcome
    exit_code: int | None = None
    output: str = Field(description="Exactly what was returned to the agent.")
    truncated: bool = False
    error_kind: str | None = None
    started_at: datetime
    duration_ms: float = Field(description="Total, from the API's receipt to its reply.")
    queue_ms: float | None = Field(None, description="Waiting in the queue for a worker.")
    exec_ms: float | None = Field(None, description="Inside the worker, running the tool.")
