"""Garbage collection of sandboxes by label: works from the daemon's state alone, so it
cleans up after any crash, including one that lost every other record."""

from __future__ import annotations

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
    backend: SandboxBackend, *, everything: bool = False, now: datetime | None = None
) -> GcReport:
    """Destroy this deployment's sandboxes that are past their expiry (or all of them)."""
    now = now or datetime.now(UTC)
    owned = backend.list_owned()
    doomed: list[SandboxHandle] = [h for h in owned if everything or h.expires_at <= now]
    for handle in doomed:
        log.info(
            "sandbox.gc",
            sandbox_id=handle.sandbox_id,
            rollout_id=handle.rollout_id,
            reason="all" if everything else "expired",
        )
        backend.destroy(handle)
        metrics.SANDBOXES_REAPED.labels("all" if everything else "expired").inc()
    leftovers = 0
    sweep = getattr(backend, "sweep_leftovers", None)
    if callable(sweep):
        leftovers = int(sweep())
    return GcReport(
        examined=len(owned), destroyed=[h.sandbox_id for h in doomed], leftovers_removed=leftovers
    )
