"""The rollout API for trainers that drive an explicit lifecycle (verl, TRL, SkyRL, ...)."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Response

from orchestrator.api.agent_rft import ERRORS
from orchestrator.api.audit import AuditRecorder
from orchestrator.api.auth import Caller, require_token
from orchestrator.api.deps import audit_recorder, service
from orchestrator.api.models import (
    ROLLOUT_ID,
    CreateRollout,
    ErrorResponse,
    RolloutCreated,
    RolloutGradeRequest,
    RolloutView,
    Score,
    ToolCallRequest,
    ToolCallResponse,
    Trajectory,
)
from orchestrator.grading import extract_answer
from orchestrator.rollouts.lookup import known
from orchestrator.rollouts.service import RolloutService
from orchestrator.state.models import RolloutSource
from orchestrator.state.records import Rollout

router = APIRouter(prefix="/v1/rollouts", tags=["rollouts"], dependencies=[Depends(require_token)])
RESPONSES = {
    **ERRORS,
    404: {"model": ErrorResponse, "description": "Unknown rollout."},
    409: {"model": ErrorResponse, "description": "Exists or ended."},
    429: {"model": ErrorResponse, "description": "Every host at capacity: retry after."},
}
Svc = Annotated[RolloutService, Depends(service)]
RolloutId = Annotated[str, Path(pattern=ROLLOUT_ID, description="The rollout's id.")]


@router.post("", status_code=201, responses=RESPONSES)
async def create_rollout(body: CreateRollout, svc: Svc, caller: Caller) -> RolloutCreated:
    """Create a rollout and its sandbox, the caller's tenant's; returns the tools' schemas
    for the model."""
    rollout_id = body.id or f"ro_{uuid.uuid4().hex}"
    rollout = await svc.start(
        rollout_id,
        body.item,
        source=RolloutSource.API,
        environment=body.environment,
        codebase=body.codebase,
        exclusive=True,
        caller=caller,
    )
    resolved = svc.environment_of(rollout)
    return RolloutCreated(
        rollout_id=rollout.rollout_id,
        environment=rollout.environment,
        codebase=rollout.codebase,
        state=rollout.state,
        host=rollout.host,
        sandbox_id=rollout.sandbox.sandbox_id if rollout.sandbox else None,
        tools=resolved.tool_schemas(),
    )


@router.post("/{rollout_id}/tools/{name}", response_model=ToolCallResponse, responses=RESPONSES)
async def call_tool(
    rollout_id: RolloutId, name: str, body: ToolCallRequest, svc: Svc, caller: Caller
) -> Response:
    """Run a tool. Agent mistakes are 200 with ``outcome: agent_error``."""
    reply = await svc.call_tool(
        rollout_id, name, body.arguments, call_id=body.call_id, caller=caller
    )
    # Serialized once, here: as agent_rft.py's tool routes (the hot path).
    response = ToolCallResponse.model_validate(reply.model_dump())
    return Response(response.model_dump_json(), media_type="application/json")


@router.post("/{rollout_id}/grade", responses=RESPONSES)
async def grade_rollout(
    rollout_id: RolloutId, body: RolloutGradeRequest, svc: Svc, caller: Caller
) -> Score:
    answer = body.answer if body.answer is not None else extract_answer(body.sample or {})
    reply = await svc.grade(
        rollout_id, answer, None, source=RolloutSource.API, sample=body.sample, caller=caller
    )
    return Score(score=reply.score, details=reply.details)


@router.get("/{rollout_id}", responses=RESPONSES)
async def get_rollout(rollout_id: RolloutId, svc: Svc, caller: Caller) -> RolloutView:
    rollout = await known(svc.store, rollout_id, caller)
    return view(rollout, await svc.store.call_count(rollout_id))


@router.get("/{rollout_id}/trajectory", responses=RESPONSES)
async def get_trajectory(rollout_id: RolloutId, svc: Svc, caller: Caller) -> Trajectory:
    rollout = await known(svc.store, rollout_id, caller)
    sandbox = rollout.sandbox
    return Trajectory(
        rollout_id=rollout_id,
        steps=await svc.store.trajectory(rollout_id),
        sandbox_id=sandbox.sandbox_id if sandbox else None,
        sandbox_reuses=sandbox.reuse_count if sandbox else None,
        sandbox_reset_digest=sandbox.reset_digest if sandbox else None,
    )


@router.delete("/{rollout_id}", responses=RESPONSES)
async def delete_rollout(
    rollout_id: RolloutId,
    svc: Svc,
    caller: Caller,
    audit: Annotated[AuditRecorder, Depends(audit_recorder)],
) -> RolloutView:
    """End the rollout now: its sandbox is destroyed (or, recycled, reset for another
    rollout); the record stays readable. An admin's end of another tenant's rollout is
    in the audit log."""
    rollout = await svc.close(rollout_id, "deleted", caller=caller)
    await audit.rollout_ended(caller, rollout, "DELETE /v1/rollouts/{rollout_id}")
    return view(rollout, await svc.store.call_count(rollout_id))


def view(rollout: Rollout, calls: int) -> RolloutView:
    ready_ms = None
    if rollout.sandbox_ready_at is not None:
        ready_ms = round((rollout.sandbox_ready_at - rollout.created_at) * 1000, 1)
    return RolloutView(
        rollout_id=rollout.rollout_id,
        source=rollout.source,
        state=rollout.state,
        environment=rollout.environment,
        codebase=rollout.codebase,
        host=rollout.host,
        sandbox_id=rollout.sandbox.sandbox_id if rollout.sandbox else None,
        runtime=rollout.sandbox.runtime if rollout.sandbox else None,
        tool_calls=calls,
        outcome=rollout.outcome,
        score=rollout.score,
        timings={
            "created_at": rollout.created_at,
            "sandbox_ready_ms": ready_ms,
            "last_activity": rollout.last_activity,
            "graded_at": rollout.graded_at,
            "closed_at": rollout.closed_at,
        },
        pool_hit=rollout.pool_hit,
        sandbox_reuses=rollout.sandbox.reuse_count if rollout.sandbox else None,
        sandbox_reset_digest=rollout.sandbox.reset_digest if rollout.sandbox else None,
        infra_failure=rollout.infra_failure,
        ended_by=rollout.ended_by,
    )
