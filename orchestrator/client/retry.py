"""The client's retry policy: which failed attempts are sent again and when.

Only errors marked ``retryable`` are retried (429 at capacity, 503 with the rollout
intact, no answer at all), always with the very same request, so the same rollout id
and ``call_id``: the server's idempotency makes a retry return a call's stored result
instead of running it twice.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from tenacity import RetryCallState, retry_if_exception, stop_after_attempt, stop_after_delay

from orchestrator.client.errors import OrchestratorError


class RetryPolicy(BaseModel):
    """How hard the client tries. ``RetryPolicy.off()`` sends every request once."""

    model_config = ConfigDict(frozen=True)

    attempts: int = Field(5, ge=1, description="Attempts in all, the first included.")
    backoff_s: float = Field(0.5, ge=0, description="First wait; doubled after each attempt.")
    max_backoff_s: float = Field(10.0, ge=0, description="Cap on any one wait.")
    max_elapsed_s: float = Field(600.0, gt=0, description="No new attempt after this long.")
    honour_retry_after: bool = Field(True, description="Wait at least the server's Retry-After.")

    @classmethod
    def off(cls) -> RetryPolicy:
        """Every request once; errors reach the caller at once."""
        return cls(attempts=1)

    def wait_s(self, attempt: int, error: BaseException | None) -> float:
        """The wait before attempt ``attempt + 1``: exponential, at least Retry-After."""
        wait = min(self.backoff_s * 2.0 ** (attempt - 1), self.max_backoff_s)
        if self.honour_retry_after and isinstance(error, OrchestratorError) and error.retry_after:
            wait = max(wait, min(error.retry_after, self.max_backoff_s))
        return wait

    def tenacity_kwargs(self) -> dict[str, Any]:
        """Arguments for ``tenacity.Retrying`` and ``tenacity.AsyncRetrying`` alike."""

        def wait(state: RetryCallState) -> float:
            error = state.outcome.exception() if state.outcome else None
            return self.wait_s(state.attempt_number, error)

        return {
            "stop": stop_after_attempt(self.attempts) | stop_after_delay(self.max_elapsed_s),
            "wait": wait,
            "retry": retry_if_exception(lambda e: isinstance(e, OrchestratorError) and e.retryable),
            "reraise": True,
        }
