"""What both clients set up the same way: timeouts, the bearer token, retry logging."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from tenacity import RetryCallState

from orchestrator.client.wire import ApiRequest
from orchestrator.observability.logging import get_logger

log = get_logger("orchestrator.client")

# A tool call may run for up to its environment's timeout (minutes) and a new rollout may
# wait for a host's capacity; the read timeout must outlast both or the client would
# retry calls that are still running.
DEFAULT_TIMEOUT = httpx.Timeout(connect=10.0, read=900.0, write=60.0, pool=60.0)


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def log_retry(request: ApiRequest) -> Callable[[RetryCallState], None]:
    """tenacity's ``before_sleep``: one warning per retried attempt."""

    def before_sleep(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        log.warning(
            "client.retry",
            op=request.op.value,
            rollout_id=request.rollout_id,
            call_id=(request.body or {}).get("call_id"),
            attempt=state.attempt_number,
            wait_s=round(state.upcoming_sleep, 3),
            error=str(error),
        )

    return before_sleep
