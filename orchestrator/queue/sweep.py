"""The host's orphan sweep: destroy this host's sandboxes that no live rollout owns. Run
by each worker when it starts and by the reaper's ``sweep_host`` task on every live host."""

from __future__ import annotations

import time

from orchestrator.config import Settings
from orchestrator.observability import metrics
from orchestrator.observability.logging import get_logger
from orchestrator.sandbox.backend import SandboxBackend, SandboxError
from orchestrator.state.connection import SyncRedis
from orchestrator.state.keys import Keys
from orchestrator.state.models import RolloutState
from orchestrator.state.pool_sizing import POOL_LABEL
from orchestrator.state.pools import pool_standings
from orchestrator.state.records import SandboxOwner, sandbox_owner, write_tombstone

log = get_logger(__name__)

RECENTLY_CLOSED_S = 5
"""A rollout closed this recently has its sandbox's destroy in flight already."""
POOL_DELIVERY_S = 120
"""How long a new pool sandbox may take from its creation to its pool's list."""
_ENDED = {RolloutState.CLOSED, RolloutState.INFRA_FAILED}
NO_RECORD = "no rollout record"


def sweep_orphans(backend: SandboxBackend, client: SyncRedis, settings: Settings) -> int:
    """Destroy this host's sandboxes that no live rollout owns: its record is gone (Redis
    lost it: the rollout is then recorded as failed, ``state_lost``, first), ended, or
    names another sandbox. Works from labels and Redis alone, so it cleans up after any
    crash, including a destroy that failed while the daemon was down.
    No age guard is needed: a rollout's record is written before its sandbox is created,
    and a record still creating names no sandbox, which spares it. Returns how many went."""
    keys = Keys.of(settings.deployment)
    destroyed = 0
    now = time.time()
    for handle in backend.list_owned():
        if not handle.rollout_id:
            continue  # ad hoc sandboxes (`orchestrator sandbox run`) go at their expiry
        rollout_id = handle.rollout_id
        # A recycled sandbox keeps the labels of the rollout it was made for: whether it
        # lies in a pool, is on its way back to one, or which rollout took it is Redis's.
        # Read just before its record (not for all at once): a sandbox may change hands
        # while earlier ones are being destroyed.
        (standing,) = pool_standings(client, keys, [handle])
        if standing.pooled:
            continue
        owner = standing.claimed_by
        if rollout_id == POOL_LABEL:
            # A young one may be on its way into its pool.
            if now - handle.created_at.timestamp() < pool_delivery_s(settings):
                continue
            rollout_id = owner or f"{POOL_LABEL}-unclaimed"
        elif owner:
            rollout_id = owner
        why = _orphaned(sandbox_owner(client, keys, rollout_id), handle.sandbox_id, now)
        if why is None:
            continue
        metrics.ORPHANS_FOUND.inc()
        if why == NO_RECORD and rollout_id == handle.rollout_id:
            # Redis lost the record of a rollout its trainer may still be driving: failed
            # first (its next call or grade a 503), then its sandbox goes.
            evidence = {"host": settings.host_id, "sandbox_id": handle.sandbox_id}
            if write_tombstone(client, keys, handle, evidence):
                log.warning(
                    "rollout.state_lost",
                    rollout_id=rollout_id,
                    sandbox_id=handle.sandbox_id,
                    host=settings.host_id,
                )
        try:
            backend.destroy(handle)
        except SandboxError as exc:
            log.warning(
                "sandbox.orphan_destroy_failed", sandbox_id=handle.sandbox_id, error=str(exc)
            )
            continue
        metrics.SANDBOXES_REAPED.labels("orphan").inc()
        destroyed += 1
        log.info(
            "sandbox.orphan_destroyed",
            sandbox_id=handle.sandbox_id,
            rollout_id=handle.rollout_id,
            reason=why,
        )
    return destroyed


def pool_delivery_s(settings: Settings) -> float:
    """How long a pool sandbox may be unclaimed after its creation began. A pod may wait
    ``k8s_pending_timeout_s`` for a node (the cluster autoscaler adding one) or an image
    pull, then for its agent: sweeping it sooner deletes it under its creator."""
    if settings.sandbox_backend != "kubernetes":
        return POOL_DELIVERY_S
    # Plus slack for the API calls around the wait and the delivery to Redis.
    creation = settings.k8s_pending_timeout_s + settings.sandbox_start_timeout_s + 30
    return max(POOL_DELIVERY_S, creation)


def _orphaned(owner: SandboxOwner, sandbox_id: str, now: float) -> str | None:
    if owner.state is None:
        return NO_RECORD
    if owner.state in _ENDED or owner.closed_at is not None:
        # Just closed: the close's own destroy is on its way; racing it gains nothing.
        if owner.closed_at is not None and now - owner.closed_at < RECENTLY_CLOSED_S:
            return None
        return f"rollout {owner.state.value}"
    if owner.sandbox_id is not None and owner.sandbox_id != sandbox_id:
        return "rollout owns another sandbox"
    return None
