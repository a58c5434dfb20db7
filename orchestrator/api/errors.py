"""Errors as HTTP answers. Every error body is ``{"error": {type, code, message}}`` where
``type`` is the outcome taxonomy's word: ``rejected`` (4xx) or ``infra_error`` (5xx)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.api.auth import e2b_control, e2b_sandbox, loggable_path
from orchestrator.e2b.control import E2BError
from orchestrator.e2b.control import error_response as e2b_error_response
from orchestrator.observability.logging import get_logger
from orchestrator.outcomes import Outcome
from orchestrator.rollouts.errors import GraderFailed, InfraError, Rejected, RejectedKind
from orchestrator.state.admission import AtCapacity
from orchestrator.state.errors import StateError
from orchestrator.state.quotas import OverQuota

RETRY_AFTER_S = "1"

log = get_logger(__name__)


def error_response(
    status: int,
    outcome: Outcome,
    code: str,
    message: str,
    *,
    rollout_id: str | None = None,
    headers: dict[str, str] | None = None,
    path: str = "",
    evidence: dict[str, Any] | None = None,
) -> JSONResponse:
    """An error answer, in the dialect of the API ``path`` belongs to: ours
    (``{"error": {type, code, message}}``), or on the E2B planes the E2B SDK's, which reads
    nothing else (docs/e2b.md)."""
    if e2b_control(path) or path in ("/files", "/health"):
        return JSONResponse(
            {"code": status, "message": message}, status_code=status, headers=headers
        )
    if e2b_sandbox(path):
        fallback = "unavailable" if status >= 500 else "invalid_argument"
        connect = CONNECT_CODES.get(status, fallback)
        return JSONResponse(
            {"code": connect, "message": message}, status_code=status, headers=headers
        )
    body: dict[str, Any] = {"type": outcome.value, "code": code, "message": message}
    if rollout_id is not None:
        body["rollout_id"] = rollout_id
    if evidence:
        body["evidence"] = evidence
    return JSONResponse({"error": body}, status_code=status, headers=headers)


CONNECT_CODES = {
    400: "invalid_argument",
    401: "unauthenticated",
    403: "permission_denied",
    404: "not_found",
    413: "resource_exhausted",
    422: "invalid_argument",
    429: "resource_exhausted",
    501: "unimplemented",
}
"""HTTP statuses as Connect codes, for errors answered before an E2B sandbox route runs."""


REJECTED_STATUS = {
    RejectedKind.NOT_FOUND: 404,
    RejectedKind.CONFLICT: 409,
    RejectedKind.INVALID: 422,
}
"""A refused request's HTTP status, by why it was refused."""


def _condense(errors: list[Any]) -> str:
    parts = []
    for error in errors[:8]:
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return "; ".join(parts)


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        path = request.url.path
        if any(e.get("type") == "json_invalid" for e in errors):
            return error_response(
                400, Outcome.REJECTED, "malformed_json", "the body is not valid JSON", path=path
            )
        # The E2B SDK parses a 400 (its generated client knows no 422).
        status = 400 if e2b_control(path) else 422
        return error_response(
            status, Outcome.REJECTED, "invalid_request", _condense(errors), path=path
        )

    @app.exception_handler(Rejected)
    async def _rejected(_: Request, exc: Rejected) -> JSONResponse:
        return error_response(REJECTED_STATUS[exc.kind], Outcome.REJECTED, exc.code, exc.message)

    @app.exception_handler(InfraError)
    async def _infra(request: Request, exc: InfraError) -> JSONResponse:
        # The trainer discards or retries on it: what it was told, and why, is on record.
        log.warning(
            "api.infra_error",
            rollout_id=exc.rollout_id,
            path=loggable_path(request.url.path),
            code=exc.code,
            error=exc.message,
        )
        return error_response(
            503,
            Outcome.INFRA_ERROR,
            exc.code,
            exc.message,
            rollout_id=exc.rollout_id,
            headers={"Retry-After": RETRY_AFTER_S},
        )

    @app.exception_handler(AtCapacity)
    async def _at_capacity(request: Request, exc: AtCapacity) -> JSONResponse:
        # Agent RFT reads any 4xx as the agent's answer: capacity must be a 5xx there (it
        # retries, then discards the rollout); the rollout API's clients get a 429.
        # A tenant at its quota (docs/tenancy.md) is answered the same way, named apart.
        headers = {"Retry-After": str(exc.retry_after_s)}
        code = "over_quota" if isinstance(exc, OverQuota) else "at_capacity"
        if request.url.path.startswith("/agent-rft"):
            return error_response(503, Outcome.INFRA_ERROR, code, exc.message, headers=headers)
        return error_response(429, Outcome.REJECTED, code, exc.message, headers=headers)

    @app.exception_handler(StateError)
    async def _state_store(request: Request, exc: StateError) -> JSONResponse:
        # Redis restarting: nothing was recorded, so a retry is safe (a call that reached a
        # worker keeps its result on its ticket, state/calls.py).
        log.error(
            "api.state_store_unavailable",
            path=loggable_path(request.url.path),
            error=repr(exc),
        )
        return error_response(
            503,
            Outcome.INFRA_ERROR,
            "state_store_unavailable",
            f"the state store (Redis) is unavailable: {type(exc).__name__}; retry",
            headers={"Retry-After": RETRY_AFTER_S},
        )

    @app.exception_handler(GraderFailed)
    async def _grader(_: Request, exc: GraderFailed) -> JSONResponse:
        return error_response(
            503,
            Outcome.INFRA_ERROR,
            exc.code,
            str(exc),
            headers={"Retry-After": RETRY_AFTER_S},
            evidence=exc.evidence,
        )

    @app.exception_handler(E2BError)
    async def _e2b(_: Request, exc: E2BError) -> JSONResponse:
        return e2b_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {
            401: "unauthorized",
            404: "not_found",
            405: "method_not_allowed",
            413: "too_large",
        }.get(exc.status_code, "http_error")
        return error_response(
            exc.status_code,
            Outcome.REJECTED,
            code,
            str(exc.detail),
            headers=getattr(exc, "headers", None),
            path=request.url.path,
        )
