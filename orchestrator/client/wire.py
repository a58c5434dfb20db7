"""The rollout API on the wire, shared by the sync and the async client: building each
request, reading each answer into the API's own models or a typed error, and deciding
what a failed attempt means (retry it, or the rollout is lost).

No I/O here; the clients send what this builds and feed back what they got.
"""

from __future__ import annotations

import uuid
from enum import StrEnum
from typing import Any, Literal, TypeVar

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError

from orchestrator.api.models import (
    CreateRollout,
    ErrorResponse,
    RolloutGradeRequest,
    RolloutView,
    ToolCallRequest,
)
from orchestrator.client.errors import (
    AtCapacity,
    Conflict,
    InfraFailure,
    InvalidRequest,
    OrchestratorError,
    RolloutNotFound,
    Unauthorized,
    Unavailable,
)

M = TypeVar("M", bound=BaseModel)

PREFIX = "/v1/rollouts"


class Op(StrEnum):
    """The rollout API's operations."""

    CREATE = "create"
    CALL = "call"
    GRADE = "grade"
    GET = "get"
    TRAJECTORY = "trajectory"
    CLOSE = "close"


class ApiRequest(BaseModel):
    """One request, ready to send; the same object is sent again on a retry, so a retry
    carries the same rollout id and ``call_id``."""

    model_config = ConfigDict(frozen=True)

    op: Op
    method: str
    path: str
    rollout_id: str
    body: dict[str, Any] | None = None


def new_rollout_id() -> str:
    """A rollout id made by the client, so a retried create names the same rollout."""
    return f"ro_{uuid.uuid4().hex}"


def new_call_id() -> str:
    """A call id made by the client: the idempotency key of one tool call."""
    return f"call_{uuid.uuid4().hex}"


def _body(model: type[BaseModel], **fields: Any) -> dict[str, Any]:
    try:
        return model.model_validate(fields).model_dump(mode="json", exclude_none=True)
    except ValidationError as exc:
        raise InvalidRequest(str(exc), code="invalid_request") from exc


def create_request(
    *,
    environment: str | None = None,
    codebase: str | None = None,
    item: dict[str, Any] | None = None,
    rollout_id: str | None = None,
) -> ApiRequest:
    rollout_id = rollout_id or new_rollout_id()
    body = _body(
        CreateRollout, environment=environment, codebase=codebase, item=item or {}, id=rollout_id
    )
    return ApiRequest(op=Op.CREATE, method="POST", path=PREFIX, rollout_id=rollout_id, body=body)


def call_request(
    rollout_id: str,
    tool: str,
    arguments: dict[str, Any] | str | None,
    *,
    call_id: str | None = None,
) -> ApiRequest:
    body = _body(ToolCallRequest, arguments=arguments, call_id=call_id or new_call_id())
    return ApiRequest(
        op=Op.CALL,
        method="POST",
        path=f"{PREFIX}/{rollout_id}/tools/{tool}",
        rollout_id=rollout_id,
        body=body,
    )


def grade_request(
    rollout_id: str, *, answer: str | None = None, sample: dict[str, Any] | None = None
) -> ApiRequest:
    body = _body(RolloutGradeRequest, answer=answer, sample=sample)
    return ApiRequest(
        op=Op.GRADE,
        method="POST",
        path=f"{PREFIX}/{rollout_id}/grade",
        rollout_id=rollout_id,
        body=body,
    )


def get_request(rollout_id: str) -> ApiRequest:
    return ApiRequest(op=Op.GET, method="GET", path=f"{PREFIX}/{rollout_id}", rollout_id=rollout_id)


def trajectory_request(rollout_id: str) -> ApiRequest:
    return ApiRequest(
        op=Op.TRAJECTORY,
        method="GET",
        path=f"{PREFIX}/{rollout_id}/trajectory",
        rollout_id=rollout_id,
    )


def close_request(rollout_id: str) -> ApiRequest:
    return ApiRequest(
        op=Op.CLOSE, method="DELETE", path=f"{PREFIX}/{rollout_id}", rollout_id=rollout_id
    )


# -- answers -------------------------------------------------------------------------------


def parse(request: ApiRequest, response: httpx.Response, model: type[M]) -> M:
    """The answer as the API's model, or the typed error its status and body name."""
    if response.is_success:
        return model.model_validate_json(response.content)
    raise error_from(request, response)


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:  # an HTTP date: rare enough to fall back on the policy's backoff
        return None


def error_from(request: ApiRequest, response: httpx.Response) -> OrchestratorError:
    """The typed error for an error answer (``{"error": {type, code, message}}``)."""
    status = response.status_code
    try:
        error = ErrorResponse.model_validate_json(response.content).error
        code, message, outcome = error.code, error.message, str(error.type)
        rollout_id = error.rollout_id or request.rollout_id
    except ValidationError:  # not ours: a proxy's page, say
        code, message, outcome = "http_error", response.text[:500], None
        rollout_id = request.rollout_id
    kw: dict[str, Any] = {
        "status": status,
        "code": code,
        "outcome": outcome,
        "rollout_id": rollout_id,
        "retry_after": _retry_after(response),
    }
    if status == 429:
        return AtCapacity(message, **kw)
    if status >= 500:
        return Unavailable(message, **kw)
    if status == 401:
        return Unauthorized(message, **kw)
    if status == 404 and code == "unknown_rollout":
        return RolloutNotFound(message, **kw)
    if status == 409:
        return Conflict(message, **kw)
    if status in (400, 413, 422):
        return InvalidRequest(message, **kw)
    return OrchestratorError(message, **kw)


def transport_error(request: ApiRequest, exc: httpx.TransportError) -> Unavailable:
    """No answer. Retrying is safe for every operation but a create that may have
    reached the server (its retry would find the id taken): only a connection that was
    never made is retried there."""
    never_sent = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout)
    return Unavailable(
        f"no answer from the orchestrator: {type(exc).__name__}: {exc}",
        code="no_answer",
        rollout_id=request.rollout_id,
        retryable=never_sent or request.op != Op.CREATE,
    )


def needs_probe(request: ApiRequest, error: OrchestratorError) -> bool:
    """A 5xx on a rollout's operation may mean the rollout failed (sticky) or only this
    attempt did: reading the rollout tells which. Reads need no such check."""
    return (
        isinstance(error, Unavailable)
        and error.status is not None
        and request.op not in (Op.GET, Op.TRAJECTORY)
    )


Probe = RolloutView | Literal["missing"] | None
"""The rollout as read right after a 5xx: its view, ``"missing"`` (no record), or None
(the read failed too, so nothing is known)."""


def read_probe(response: httpx.Response) -> Probe:
    """The probe's answer to :func:`get_request`, never an exception."""
    if response.status_code == 404:
        return "missing"
    if not response.is_success:
        return None
    try:
        return RolloutView.model_validate_json(response.content)
    except ValidationError:
        return None


def settle(request: ApiRequest, error: OrchestratorError, probe: Probe) -> OrchestratorError:
    """What a 5xx means, given the rollout as read right after it.

    An ``infra_failed`` rollout is an :class:`InfraFailure` (discard, do not retry). A
    create whose rollout exists anyway is not retried (its retry would be a 409).
    """
    view = probe if isinstance(probe, RolloutView) else None
    if view is not None and (view.state == "infra_failed" or view.infra_failure):
        failure = view.infra_failure or {}
        return InfraFailure(
            f"rollout {view.rollout_id} failed for infrastructure reasons and must be "
            f"discarded: {failure.get('message') or error.message}",
            status=error.status,
            code=str(failure.get("cause") or error.code),
            outcome="infra_error",
            rollout_id=view.rollout_id,
            infra_failure=failure,
        )
    if request.op == Op.CREATE and view is not None:
        return Unavailable(
            error.message,
            status=error.status,
            code=error.code,
            outcome=error.outcome,
            rollout_id=error.rollout_id,
            retryable=False,
        )
    return error
