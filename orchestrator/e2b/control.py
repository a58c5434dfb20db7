"""The E2B control plane (docs/e2b.md): the REST calls the SDK's ``Sandbox`` class makes to
its API URL, authenticated by ``X-API-KEY`` (a tenant's token: it sees its tenant's sandboxes and
snapshots only, docs/tenancy.md).

The SDK's generated client is strict about shapes: a create answers 201, a kill or a timeout
204, and every error ``{"code": <int>, "message": ...}`` (anything else crashes its
parser). A kill of an unknown sandbox is a 404 (the SDK returns False).
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import parse_qsl

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse

from orchestrator.api.audit import AuditRecorder
from orchestrator.api.auth import authenticated
from orchestrator.api.deps import audit_recorder, state
from orchestrator.e2b.models import (
    ConnectBody,
    ForkBody,
    NewSandbox,
    PauseBody,
    SnapshotBody,
    TimeoutBody,
    wire_json,
)
from orchestrator.e2b.sandboxes import BadRequest, E2BSandboxes, SandboxGone
from orchestrator.rollouts.errors import InfraError, Rejected, RejectedKind
from orchestrator.state.admission import AtCapacity
from orchestrator.tenants import Principal


class E2BError(Exception):
    """An error answer of the control plane."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def error_response(exc: E2BError) -> JSONResponse:
    return JSONResponse(
        {"code": exc.status, "message": exc.message}, status_code=exc.status, headers=exc.headers
    )


async def api_key_caller(request: Request) -> Principal:
    """Who the SDK's ``X-API-KEY`` acts for: a token of a tenant (docs/tenancy.md). The
    guard authenticated it before the body was read; this is the route's dependency."""
    found = authenticated(request)
    if found is None:
        raise E2BError(401, "missing or wrong X-API-KEY")
    return found


async def sandboxes(request: Request) -> E2BSandboxes:
    found: E2BSandboxes = state(request).e2b
    return found


# Not in the OpenAPI document: its contract is E2B's (docs/e2b.md), its clients their SDK.
router = APIRouter(include_in_schema=False)
Sandboxes = Annotated[E2BSandboxes, Depends(sandboxes)]
Caller = Annotated[Principal, Depends(api_key_caller)]


E2B_REJECTED_STATUS = {
    RejectedKind.NOT_FOUND: 404,
    RejectedKind.CONFLICT: 409,
    RejectedKind.INVALID: 400,  # the SDK's generated client knows no 422
}
"""A refused request's status as the E2B SDK reads it."""


def _translate(exc: Exception, sandbox_id: str | None = None) -> E2BError:
    """What the SDK should hear for the service's errors."""
    if isinstance(exc, SandboxGone):
        return E2BError(404, f"sandbox {exc.sandbox_id} not found")
    if isinstance(exc, BadRequest):
        return E2BError(400, str(exc))
    if isinstance(exc, Rejected):
        return E2BError(E2B_REJECTED_STATUS[exc.kind], exc.message)
    if isinstance(exc, AtCapacity):
        return E2BError(429, exc.message, {"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, InfraError):
        where = f"sandbox {sandbox_id} " if sandbox_id else ""
        # A failed sandbox stays failed: asking again changes nothing (the SDK retries a
        # 503 unless told not to); a call never run may be retried.
        retry = "true" if exc.code == "not_run" else "false"
        return E2BError(
            503,
            f"{where}failed for infrastructure reasons ({exc.code}): {exc.message}",
            {"Retry-After": "1", "Should-Retry": retry},
        )
    raise exc


@router.post("/sandboxes", status_code=201)
@router.post("/v2/sandboxes", status_code=201)
async def create_sandbox(body: NewSandbox, svc: Sandboxes, caller: Caller) -> JSONResponse:
    """``Sandbox.create(template=...)``."""
    try:
        made = await svc.create(body, caller)
    except (BadRequest, Rejected, AtCapacity, InfraError) as exc:
        return error_response(_translate(exc))
    return JSONResponse(wire_json(made), status_code=201)


@router.get("/sandboxes")
@router.get("/v2/sandboxes")
async def list_sandboxes(
    svc: Sandboxes,
    caller: Caller,
    metadata: str = "",
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    next_token: Annotated[str, Query(alias="nextToken")] = "",
) -> JSONResponse:
    """``Sandbox.list()``: the live sandboxes, paginated by ``x-next-token``."""
    wanted = dict(parse_qsl(metadata, keep_blank_values=True))
    after = int(next_token) if next_token.isdigit() else 0
    page, following = await svc.listing(metadata=wanted, limit=limit, after=after, caller=caller)
    headers = {"x-next-token": str(following)} if following is not None else {}
    return JSONResponse([wire_json(d) for d in page], headers=headers)


@router.get("/sandboxes/{sandbox_id}")
async def get_sandbox(sandbox_id: str, svc: Sandboxes, caller: Caller) -> JSONResponse:
    """``Sandbox.get_info()``."""
    try:
        return JSONResponse(wire_json(await svc.detail(sandbox_id, caller)))
    except (SandboxGone, InfraError) as exc:
        return error_response(_translate(exc, sandbox_id))


@router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def kill_sandbox(
    sandbox_id: str,
    svc: Sandboxes,
    caller: Caller,
    audit: Annotated[AuditRecorder, Depends(audit_recorder)],
) -> Response:
    """``sandbox.kill()``: 204, or 404 when there is no such live sandbox. An admin's kill
    of another tenant's sandbox is in the audit log."""
    killed = await svc.kill(sandbox_id, caller)
    if killed is None:
        return error_response(E2BError(404, f"sandbox {sandbox_id} not found"))
    await audit.rollout_ended(caller, killed, "DELETE /sandboxes/{sandbox_id}")
    return Response(status_code=204)


@router.get("/sandboxes/{sandbox_id}/metrics")
async def sandbox_metrics(sandbox_id: str, svc: Sandboxes, caller: Caller) -> JSONResponse:
    """``sbx.get_metrics()``: what it uses now, one entry (none while it is paused)."""
    try:
        return JSONResponse([wire_json(m) for m in await svc.metrics(sandbox_id, caller)])
    except (SandboxGone, InfraError) as exc:
        return error_response(_translate(exc, sandbox_id))


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
async def set_timeout(
    sandbox_id: str, body: TimeoutBody, svc: Sandboxes, caller: Caller
) -> Response:
    """``sandbox.set_timeout(seconds)``: it is killed that long from now."""
    try:
        await svc.set_timeout(sandbox_id, body.timeout, caller)
    except (SandboxGone, BadRequest, InfraError) as exc:
        return error_response(_translate(exc, sandbox_id))
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/connect")
@router.post("/v2/sandboxes/{sandbox_id}/connect")
async def connect_sandbox(
    sandbox_id: str, body: ConnectBody, svc: Sandboxes, caller: Caller
) -> JSONResponse:
    """``Sandbox.connect(id)``: the same sandbox, for another client; a paused one resumes
    (201, as E2B answers a resume)."""
    try:
        out, resumed = await svc.connect(sandbox_id, body.timeout, caller)
    except (SandboxGone, BadRequest, Rejected, AtCapacity, InfraError) as exc:
        return error_response(_translate(exc, sandbox_id))
    return JSONResponse(wire_json(out), status_code=201 if resumed else 200)


@router.post("/sandboxes/{sandbox_id}/resume", status_code=201)
async def resume_sandbox(
    sandbox_id: str, body: ConnectBody, svc: Sandboxes, caller: Caller
) -> JSONResponse:
    """The older SDKs' ``resume``: as ``connect``; 409 when it was not paused."""
    try:
        out, resumed = await svc.connect(sandbox_id, body.timeout, caller)
    except (SandboxGone, BadRequest, Rejected, AtCapacity, InfraError) as exc:
        return error_response(_translate(exc, sandbox_id))
    if not resumed:
        return error_response(E2BError(409, f"sandbox {sandbox_id} is not paused"))
    return JSONResponse(wire_json(out), status_code=201)


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
async def pause_sandbox(
    sandbox_id: str, body: PauseBody, svc: Sandboxes, caller: Caller
) -> Response:
    """``sbx.pause()``: 204; 409 when it is paused already (the SDK returns False)."""
    try:
        if not await svc.pause(sandbox_id, body.memory, caller):
            return error_response(E2BError(409, f"sandbox {sandbox_id} is paused already"))
    except (SandboxGone, BadRequest, Rejected, InfraError) as exc:
        return error_response(_translate(exc, sandbox_id))
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
async def create_snapshot(
    sandbox_id: str, body: SnapshotBody, svc: Sandboxes, caller: Caller
) -> JSONResponse:
    """``sbx.create_snapshot(name)``: its filesystem, kept (docs/snapshots.md)."""
    try:
        made = await svc.snapshot(sandbox_id, body.name, body.memory, caller)
    except (SandboxGone, BadRequest, Rejected, InfraError) as exc:
        return error_response(_translate(exc, sandbox_id))
    return JSONResponse(wire_json(made), status_code=201)


@router.get("/snapshots")
async def list_snapshots(
    svc: Sandboxes,
    caller: Caller,
    sandbox_id: Annotated[str, Query(alias="sandboxID")] = "",
    name: str = "",
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    next_token: Annotated[str, Query(alias="nextToken")] = "",
) -> JSONResponse:
    """``Sandbox.list_snapshots()``: paginated by ``x-next-token``."""
    after = int(next_token) if next_token.isdigit() else 0
    page, following = await svc.snapshots_listing(
        sandbox_id=sandbox_id or None, name=name or None, limit=limit, after=after, caller=caller
    )
    headers = {"x-next-token": str(following)} if following is not None else {}
    return JSONResponse([wire_json(s) for s in page], headers=headers)


@router.delete("/templates/{template_id}", status_code=204)
async def delete_snapshot(template_id: str, svc: Sandboxes, caller: Caller) -> Response:
    """``Sandbox.delete_snapshot(id)``: 204, or 404 when there is no such snapshot (a
    template here is an environment or a codebase, which the API never deletes)."""
    if not await svc.drop_snapshot(template_id, caller):
        return error_response(E2BError(404, f"snapshot {template_id} not found"))
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
async def fork_sandbox(
    sandbox_id: str, body: ForkBody, svc: Sandboxes, caller: Caller
) -> JSONResponse:
    """``sbx.fork(count)``: one entry per fork, its sandbox or its own error."""
    try:
        made = await svc.fork(sandbox_id, body.count, body.timeout, caller)
    except (SandboxGone, BadRequest, Rejected, InfraError) as exc:
        return error_response(_translate(exc, sandbox_id))
    results: list[dict[str, object]] = []
    for one in made:
        if isinstance(one, BaseException):
            failed = _translate_fork(one)
            results.append({"error": {"code": failed.status, "message": failed.message}})
        else:
            results.append({"sandbox": wire_json(one)})
    return JSONResponse(results, status_code=201)


def _translate_fork(exc: BaseException) -> E2BError:
    if isinstance(exc, (SandboxGone, BadRequest, Rejected, AtCapacity, InfraError)):
        return _translate(exc)
    return E2BError(500, f"the fork failed: {type(exc).__name__}: {exc}")
