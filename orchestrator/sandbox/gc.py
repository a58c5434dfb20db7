"""Garbage collection of sandboxes by label: works from the daemon's state alone, so it
cleans up after any crash, including one that lost every other record."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

from pydantic import BaseModel

from orchestrator.observability import metrics
from orchestrator.observability.logging import get_logger
from orchestrator.sandbox.backend import SandboxBackend, SandboxHandle

log = get_logger(__name__)


class GcReport(BaseModel):
    """What one collection pass did."""

    examined: int
    destroyed: list[str]
    leftovers_removed: int = 0


def collect_expired(
    backend: SandboxBackend,
    *,
    everything: bool = False,
    now: datetime | None = None,
    parallel: int = 1,
) -> GcReport:
    """Destroy this deployment's sandboxes that are past their expiry (or all of them),
    ``parallel`` at a time (a destroy mostly waits on the daemon)."""
    now = now or datetime.now(UTC)
    owned = backend.list_owned()
    doomed: list[SandboxHandle] = [h for h in owned if everything or h.expires_at <= now]
    reason = "all" if everything else "expired"

    def destroy(handle: SandboxHandle) -> None:
        log.info(
            "sandbox.gc", sandbox_id=handle.sandbox_id, rollout_id=handle.rollout_id, reason=reason
        )
        backend.destroy(handle)
        metrics.SANDBOXES_REAPED.labels(reason).inc()

    if parallel <= 1 or len(doomed) <= 1:
        for handle in doomed:
            destroy(handle)
    else:
        with ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="gc") as pool:
            # list(): the first destroy that failed raises here, as the loop above would.
            list(pool.map(destroy, doomed))
    leftovers = 0
    sweep = getattr(backend, "sweep_leftovers", None)
    if callable(sweep):
        leftovers = int(sweep(everything=everything))
    return GcReport(
        examined=len(owned), destroyed=[h.sandbox_id for h in doomed], leftovers_removed=leftovers
    )
