"""What can go wrong with a rollout, named by whose fault it is (DESIGN.md's taxonomy)."""

from __future__ import annotations

from typing import Any


class InfraError(Exception):
    """Our fault: the trainer must get a 5xx and discard the rollout, never a score."""

    def __init__(self, message: str, *, rollout_id: str, evidence: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        self.rollout_id = rollout_id
        self.evidence = evidence or {}


class Rejected(Exception):
    """The request itself is wrong (unknown rollout, environment or codebase, bad state).
    Changes no state."""

    def __init__(self, status: int, message: str, *, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


class GraderFailed(Exception):
    """The grader raised: a 503 so the trainer retries, never a zero."""


class CallNotRun(InfraError):
    """The call never ran (its host's worker was gone, or the queue never got to it) and
    never will: a 503 whose retry may run it. The rollout itself is intact."""


class CallLost(InfraError):
    """The worker running the call died (or the call overran every bound): it may have
    run in part, so the rollout is marked infra_failed with ``cause``."""

    def __init__(
        self,
        message: str,
        *,
        rollout_id: str,
        evidence: dict[str, Any] | None = None,
        cause: str = "worker_lost",
    ) -> None:
        super().__init__(message, rollout_id=rollout_id, evidence=evidence)
        self.cause = cause
