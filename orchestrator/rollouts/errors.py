"""What can go wrong with a rollout, named by whose fault it is (docs/failure-model.md)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from orchestrator.outcomes import Cause


class InfraError(Exception):
    """Our fault: the trainer must get a 5xx and discard the rollout, never a score.

    ``code`` says why in a word the trainer's logs can count: the cause recorded on an
    ``infra_failed`` rollout (``idle_reaped``, ``host_lost``, ``worker_lost``, ...), or
    ``not_run`` for a call that never ran and may be retried.
    """

    def __init__(
        self,
        message: str,
        *,
        rollout_id: str,
        evidence: dict[str, Any] | None = None,
        code: str = Cause.INFRA_ERROR,
    ):
        super().__init__(message)
        self.message = message
        self.rollout_id = rollout_id
        self.evidence = evidence or {}
        self.code = code


class RejectedKind(StrEnum):
    """Why a request is refused: each interface says it its own way (the HTTP API in
    api/errors.py, the E2B API in e2b/control.py)."""

    NOT_FOUND = "not_found"
    """What it names does not exist (a rollout, a snapshot)."""
    CONFLICT = "conflict"
    """It exists, and its state does not allow this now (not running yet, already made)."""
    INVALID = "invalid"
    """What it asks for cannot be (an unknown environment or codebase, a row that cannot
    be graded, a set-up step that failed)."""


class Rejected(Exception):
    """The request itself is wrong (unknown rollout, environment or codebase, bad state).
    Changes no state."""

    def __init__(self, kind: RejectedKind, message: str, *, code: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.code = code


class GraderFailed(Exception):
    """The grader raised, or what it depends on failed: a 503 so the trainer retries,
    never a zero. ``code`` names why (``grader_failed``, or the grader's own kind, such as
    ``judge_timeout``), ``evidence`` what was seen."""

    def __init__(
        self, message: str, *, code: str = "grader_failed", evidence: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.evidence = evidence or {}


class CallNotRun(InfraError):
    """The call never ran (its host's worker was gone, or the queue never got to it) and
    never will: a 503 whose retry may run it. The rollout itself is intact."""

    def __init__(
        self, message: str, *, rollout_id: str, evidence: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message, rollout_id=rollout_id, evidence=evidence, code=Cause.NOT_RUN)


class CallLost(InfraError):
    """The worker running the call died (or the call overran every bound): it may have
    run in part, so the rollout is marked infra_failed with ``cause``."""

    def __init__(
        self,
        message: str,
        *,
        rollout_id: str,
        evidence: dict[str, Any] | None = None,
        cause: Cause = Cause.WORKER_LOST,
    ) -> None:
        super().__init__(message, rollout_id=rollout_id, evidence=evidence, code=cause)
        self.cause = cause


class StillStarting(InfraError):
    """The rollout's sandbox is still being made when the request's time is up (Agent
    RFT's bound): a 503 whose retry finds the rollout and its sandbox. Fails nothing."""

    def __init__(self, rollout_id: str) -> None:
        super().__init__(
            "the rollout's sandbox is still being made and this request's time is up; retry",
            rollout_id=rollout_id,
            code=Cause.STARTING,
        )


class CallPending(InfraError):
    """Another attempt of the same call is still running when the request's time is up:
    a 503 whose retry gets its result. Fails nothing."""

    def __init__(self, rollout_id: str) -> None:
        super().__init__(
            "an earlier attempt of this call is still running and this request's time is up; "
            "retry to get its result",
            rollout_id=rollout_id,
            code=Cause.CALL_IN_PROGRESS,
        )


class GradePending(InfraError):
    """Another grade of the rollout is still running its grader in the sandbox when the
    request's time is up: a 503 whose retry gets the score it stores. Fails nothing."""

    def __init__(self, rollout_id: str) -> None:
        super().__init__(
            "an earlier grade of this rollout is still running its tests and this request's "
            "time is up; retry to get its score",
            rollout_id=rollout_id,
            code=Cause.CALL_IN_PROGRESS,
        )


class RolloutVanished(InfraError):
    """The rollout's record went away while we worked on it (records never expire, so
    Redis lost it): our fault, a 503, and nothing left to score. An id the client never
    created is :func:`orchestrator.rollouts.lookup.unknown` instead, a 404."""

    def __init__(self, rollout_id: str, during: str) -> None:
        super().__init__(
            f"the rollout vanished while {during}", rollout_id=rollout_id, code=Cause.STATE_LOST
        )
