"""Pydantic models of what operators see: a status snapshot, rollout summaries and details."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from orchestrator.outcomes import Outcome
from orchestrator.sandbox.daemon_share import DaemonShare
from orchestrator.state.models import RolloutState, TrajectoryStep
from orchestrator.state.records import GradeInputs, InfraFailureEntry
from orchestrator.tenants import DEFAULT_TENANT


class HostView(BaseModel):
    """One worker host, from its heartbeat (queue/worker.py) and its admission slots."""

    host: str
    alive: bool = Field(description="Its heartbeat is live.")
    healthy: bool = Field(description="Its daemon probe succeeded.")
    schedulable: bool = Field(description="It takes new sandboxes (not cordoned).")
    cordon_reasons: list[str] = Field(default_factory=list)
    draining: bool = False
    capacity: int | None = None
    slots_used: int = Field(0, description="Admission slots held (rollouts' and pools').")
    sandboxes: int | None = Field(None, description="Sandboxes its daemon holds.")
    live_rollouts: int = 0
    running_calls: int = 0
    backend_failures: int = 0
    backend_ping_ms: float | None = None
    disk_free_bytes: int | None = None
    mem_available_bytes: int | None = None
    heartbeat_age_s: float | None = None
    error: str | None = None
    daemon_cpu: DaemonShare | None = Field(
        None, description="The CPU weight of the daemons that create its sandboxes."
    )


class PoolView(BaseModel):
    """One warm pool: ready sandboxes, those being made, and its configured size."""

    pool: str
    environment: str
    codebase: str | None = None
    ready: int
    creating: int
    target: int | None = Field(None, description="pool_size; None: no longer configured.")


class QueueDepth(BaseModel):
    """Celery messages waiting in one queue."""

    queue: str
    depth: int


class AdmissionView(BaseModel):
    """Capacity: slots used of the live hosts' total, and rollouts waiting for one."""

    waiting: int
    slots_used: int
    slots_total: int
    tenants: dict[str, int] = Field(
        default_factory=dict, description="Sandboxes held per tenant (docs/tenancy.md)."
    )


class RolloutSummary(BaseModel):
    """One rollout, as a listing shows it."""

    rollout_id: str
    trace_id: str | None = Field(None, description="Agent RFT's trace id (its rollout id).")
    source: str
    tenant: str = Field(DEFAULT_TENANT, description="Whose it is (docs/tenancy.md).")
    environment: str
    codebase: str | None = None
    state: RolloutState
    outcome: Outcome | None = None
    calls: int
    score: float | None = None
    host: str | None = None
    sandbox_id: str | None = None
    pool_hit: bool | None = None
    created_at: float
    age_s: float
    infra_cause: str | None = None


class SandboxCounts(BaseModel):
    """Sandboxes by state: those of live rollouts (by the rollout's state) and warm ones."""

    rollouts_by_state: dict[str, int] = Field(default_factory=dict)
    active_by_host_environment: dict[str, dict[str, int]] = Field(default_factory=dict)
    pool_ready: int = 0
    pool_creating: int = 0


class PhaseLatency(BaseModel):
    """Latency of one phase of a tool call over the window, from histogram bucket deltas."""

    phase: str
    count: int
    p50_ms: float | None = None
    p99_ms: float | None = None


class CallStats(BaseModel):
    """Tool calls over the window between two scrapes of the API's /metrics."""

    api_url: str
    window_s: float = 0.0
    calls: float = 0.0
    rate_per_s: float = 0.0
    by_outcome: dict[str, float] = Field(default_factory=dict)
    infra_error_ratio: float | None = Field(None, description="infra_error / all, in the window.")
    latency: list[PhaseLatency] = Field(default_factory=list)
    infra_errors_by_cause: dict[str, float] = Field(default_factory=dict)
    calls_since_start: float = 0.0
    error: str | None = Field(None, description="Why /metrics could not be read.")


class StatusSnapshot(BaseModel):
    """Everything ``orchestrator status`` shows, at one moment."""

    deployment: str
    taken_at: float
    redis_ok: bool
    redis_error: str | None = None
    hosts: list[HostView] = Field(default_factory=list)
    sandboxes: SandboxCounts = Field(default_factory=SandboxCounts)
    live_rollouts: int = 0
    newest_live: list[RolloutSummary] = Field(default_factory=list)
    pools: list[PoolView] = Field(default_factory=list)
    queues: list[QueueDepth] = Field(default_factory=list)
    admission: AdmissionView | None = None
    recent_failures: list[InfraFailureEntry] = Field(default_factory=list)
    calls: CallStats | None = None


class RolloutDetail(BaseModel):
    """One rollout in full: its record and its trajectory, step by step."""

    summary: RolloutSummary
    item: dict[str, Any] = Field(default_factory=dict)
    sandbox_ready_at: float | None = None
    graded_at: float | None = None
    closed_at: float | None = None
    last_activity: float
    calls_in_flight: int = 0
    grade_details: dict[str, Any] | None = None
    grade_inputs: GradeInputs | None = Field(
        None, description="What the score was computed from: answer, sample, grader, digests."
    )
    infra_failure: dict[str, Any] | None = None
    trajectory: list[TrajectoryStep] = Field(default_factory=list)


class SandboxView(BaseModel):
    """One sandbox of this deployment on this host, as ``orchestrator sandbox ls`` shows it."""

    sandbox_id: str
    owner: str = Field(
        description="Who holds it now: a rollout id, 'pool' (it lies in a warm pool or is "
        "being recycled into one), or '' (an ad hoc sandbox of `sandbox run`). Read from "
        "Redis; the label's first owner when Redis could not be read (owner_known False)."
    )
    owner_known: bool = Field(description="The owner was read from Redis, not the label.")
    recycling: bool = Field(False, description="On its way back to its pool, being reset.")
    first_rollout: str = Field(
        description="The rollout it was made for (its label, fixed at creation; 'pool' for "
        "one made for a pool): a hint, stale once the sandbox is recycled."
    )
    host: str
    runtime: str
    image: str
    created_at: datetime
    expires_at: datetime


class SandboxListing(BaseModel):
    """This host's sandboxes of the deployment, oldest first."""

    sandboxes: list[SandboxView]
    redis_error: str | None = Field(
        None, description="Why owners are the labels' (Redis could not be read), or None."
    )
