"""What the rollout API's errors become in the client: one exception per thing a trainer
does differently (docs/failure-model.md).

``retryable`` says whether sending the same request again (the same ``call_id``, the same
rollout id) is safe and may succeed; the client's retry policy retries exactly those.
"""

from __future__ import annotations

from typing import Any


class OrchestratorError(Exception):
    """Any error answer of the rollout API (or no answer at all).

    ``status`` is the HTTP status (None when the request never got an answer), ``code``
    the error body's ``error.code``, ``outcome`` its ``error.type`` (``rejected`` or
    ``infra_error``).
    """

    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str = "error",
        outcome: str | None = None,
        rollout_id: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.outcome = outcome
        self.rollout_id = rollout_id
        self.retry_after = retry_after

    def __str__(self) -> str:
        where = f" (rollout {self.rollout_id})" if self.rollout_id else ""
        return f"{self.status or '-'} {self.code}: {self.message}{where}"


class InvalidRequest(OrchestratorError):
    """400, 413 or 422: the request itself is wrong (body, environment, codebase, row).
    Nothing changed on the server; sending it again fails the same way."""


class Unauthorized(OrchestratorError):
    """401: missing or wrong bearer token."""


class RolloutNotFound(OrchestratorError):
    """404 ``unknown_rollout``: no rollout has that id."""


class Conflict(OrchestratorError):
    """409: the rollout id exists already (``exists``) or the rollout has ended
    (``ended``: graded or closed)."""


class AtCapacity(OrchestratorError):
    """429 ``at_capacity``: every host is full. Nothing was recorded; retry after
    ``retry_after`` seconds with the same request."""

    retryable = True


class Unavailable(OrchestratorError):
    """503 (or no answer): the orchestrator could not serve the request now, and the
    rollout is intact. A retry with the same ``call_id`` is safe: a call that already ran
    returns its stored result, one that never ran runs once."""

    retryable = True

    def __init__(self, message: str, *, retryable: bool = True, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.retryable = retryable


class InfraFailure(OrchestratorError):
    """The rollout is ``infra_failed``: our fault, sticky. The trainer must DISCARD this
    rollout (drop the sample), never score it, and never retry it: every later call and
    its grade fail the same way. ``infra_failure`` holds the recorded cause and evidence."""

    def __init__(
        self, message: str, *, infra_failure: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        super().__init__(message, **kw)
        self.infra_failure = infra_failure or {}
