"""Agent RFT's tool endpoint and endpoint grader (docs/agent-rft.md).

The rollout's identity is the body's ``trace_id``; its first tool call creates its sandbox.
Agent mistakes are 200s whose ``output`` explains; infrastructure faults are 503s.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Response

from orchestrator.api.auth import Caller, require_secret, require_token
from orchestrator.api.deps import service
from orchestrator.api.models import (
    ErrorResponse,
    FunctionCall,
    FunctionCallOutput,
    GradeRequest,
    Score,
)
from orchestrator.grading import extract_answer
from orchestrator.rollouts.service import RolloutService
from orchestrator.state.models import RolloutSource
from orchestrator.tenants import Principal

router = APIRouter(prefix="/agent-rft", tags=["agent-rft"], dependencies=[Depends(require_token)])

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Malformed JSON."},
    401: {"model": ErrorResponse, "description": "Missing or wrong bearer token."},
    409: {"model": ErrorResponse, "description": "The rollout has ended (graded or closed)."},
    413: {"model": ErrorResponse, "description": "Body over the size limit."},
    422: {"model": ErrorResponse, "description": "Invalid body, unknown environment or codebase."},
    503: {
        "model": ErrorResponse,
        "description": "Infrastructure fault or every host at capacity: retry, then discard.",
    },
}


async def _call(body: FunctionCall, name: str, svc: RolloutService, caller: Principal) -> Response:
    reply = await svc.call_tool(
        body.trace_id,
        name,
        body.arguments,
        call_id=body.call_id,
        item=body.item,
        source=RolloutSource.AGENT_RFT,
        caller=caller,
    )
    output = FunctionCallOutput(call_id=body.call_id, id=body.id, output=reply.output)
    # Serialized here, once: FastAPI would validate the model again against the route's
    # response model, then encode it (the hot path, docs/architecture.md).
    return Response(output.model_dump_json(), media_type="application/json")


@router.post("/tools", response_model=FunctionCallOutput, responses=ERRORS)
async def tool_call(
    body: FunctionCall, svc: Annotated[RolloutService, Depends(service)], caller: Caller
) -> Response:
    """One tool call; the tool is the body's ``name`` (several tools may share this URL)."""
    if not body.name:
        raise HTTPException(422, "body.name: the tool name is required on this endpoint")
    return await _call(body, body.name, svc, caller)


@router.post("/tools/{name}", response_model=FunctionCallOutput, responses=ERRORS)
async def named_tool_call(
    name: str, body: FunctionCall, svc: Annotated[RolloutService, Depends(service)], caller: Caller
) -> Response:
    """One tool call to the tool named in the path (the body's ``name`` is ignored)."""
    return await _call(body, name, svc, caller)


# The endpoint grader without a header, under the deployment's secret path segment
# (settings.grader_url_secret): Azure's endpoint grader "does not support auth header for
# now" (docs/agent-rft.md). Not in the OpenAPI document: its path is a credential.
secret_grader = APIRouter(
    prefix="/agent-rft", dependencies=[Depends(require_secret)], include_in_schema=False
)


@router.post("/grade", responses=ERRORS)
async def grade(
    body: GradeRequest, svc: Annotated[RolloutService, Depends(service)], caller: Caller
) -> Score:
    """Score a rollout. Idempotent; an infra-failed rollout gets 503, never a score."""
    return await _grade(body, svc, caller)


@secret_grader.post("/grade/{secret}")
async def grade_by_secret(
    body: GradeRequest, svc: Annotated[RolloutService, Depends(service)], caller: Caller
) -> Score:
    """:func:`grade`, for a grader that sends no header: the secret's tenant's."""
    return await _grade(body, svc, caller)


async def _grade(body: GradeRequest, svc: RolloutService, caller: Principal) -> Score:
    reply = await svc.grade(
        body.trace_id,
        extract_answer(body.sample),
        body.item,
        source=RolloutSource.AGENT_RFT,
        sample=body.sample,
        caller=caller,
    )
    return Score(score=reply.score, details=reply.details)
