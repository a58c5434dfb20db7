"""The reaper (run by beat): ends rollouts that are idle, too old, or graded and past their
grace period; fails the rollouts of hosts that are lost or unhealthy; and has every live
host sweep its expired and orphaned sandboxes (:func:`sweep_orphans`, also run by each
worker when it starts)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis

from orchestrator.config import Settings
from orchestrator.observability import metrics
from orchestrator.observability.logging import bind_sandbox, get_logger, rollout_context
from orchestrator.outcomes import Cause
from orchestrator.queue.app import celery_app
from orchestrator.queue.client import QueueClient
from orchestrator.queue.worker import environments
from orchestrator.rollouts.errors import InfraError
from orchestrator.rollouts.models import RolloutState
from orchestrator.rollouts.pools import POOL_LABEL, pool_key, pool_owner, targets
from orchestrator.rollouts.service import RolloutService
from orchestrator.rollouts.store import Rollout, RolloutStore
from orchestrator.sandbox.backend import SandboxBackend, SandboxError, SandboxHandle

log = get_logger(__name__)

# A rollout closed this recently has its sandbox's destroy in flight already.
RECENTLY_CLOSED_S = 5
# How long a new pool sandbox may take from its creation to its pool's list.
POOL_DELIVERY_S = 120
_ENDED = {RolloutState.CLOSED.value, RolloutState.INFRA_FAILED.value}


class EndReason(StrEnum):
    """Why the reaper ends a rollout; also the ``reason`` label of sandboxes reaped."""

    IDLE = "idle"
    GRADED = "graded"
    MAX_LIFETIME = "max_lifetime"
    INFRA_FAILED = "infra_failed"
    STUCK_CREATING = "stuck_creating"
    UNCONFIGURED = "unconfigured"
    CLIENT_TIMEOUT = "client_timeout"
    """An E2B sandbox past the timeout its client set (docs/e2b.md)."""


# The reaper's own ends of a rollout not graded yet: the trainer may still be working on
# it, so it is ended with a cause that fails its next call or grade (never scored).
_ENDED_BY_US = {
    EndReason.IDLE: Cause.IDLE_REAPED,
    EndReason.MAX_LIFETIME: Cause.LIFETIME_EXCEEDED,
    EndReason.UNCONFIGURED: Cause.ENVIRONMENT_REMOVED,
}


@dataclass(frozen=True)
class End:
    """A rollout to end, and what to tell a trainer that comes back to it."""

    reason: EndReason
    why: str = ""


def reason_to_end(rollout: Rollout, service: RolloutService, now: float) -> End | None:
    """Why this rollout should end now, or None to keep it. Its limits are those of the
    environment it was pinned to when it started."""
    if rollout.closed_at is not None:
        return None
    if rollout.environment not in service.environments:
        return End(
            EndReason.UNCONFIGURED,
            f"its environment {rollout.environment!r} was removed from the configuration",
        )
    if rollout.state == RolloutState.INFRA_FAILED:
        return End(EndReason.INFRA_FAILED)
    try:
        config = service.environment_of(rollout).environment
    except InfraError:
        return End(EndReason.UNCONFIGURED, "its environment is no longer configured")
    lifetime = config.effective_lifetime_s(service.settings)
    if now - rollout.created_at > lifetime:
        return End(EndReason.MAX_LIFETIME, f"it passed its maximum lifetime of {lifetime} s")
    if rollout.state == RolloutState.GRADED and rollout.graded_at is not None:
        graded = now - rollout.graded_at > config.grace_after_grade_s
        return End(EndReason.GRADED) if graded else None
    if rollout.state == RolloutState.CREATING:
        limit = service.settings.sandbox_create_timeout_s * 2
        return End(EndReason.STUCK_CREATING) if now - rollout.created_at > limit else None
    if rollout.e2b is not None:
        # An E2B sandbox lives until its client's timeout (which set_timeout moves), as on
        # E2B: its client, not an idle rule, says when it is done.
        end_at = float(rollout.e2b.get("end_at") or 0)
        return End(EndReason.CLIENT_TIMEOUT) if now > end_at else None
    if rollout.calls_in_flight <= 0 and now - rollout.last_activity > config.idle_timeout_s:
        return End(
            EndReason.IDLE,
            f"no tool call for {now - rollout.last_activity:.0f} s, past the environment's "
            f"idle_timeout_s of {config.idle_timeout_s} s",
        )
    return None


async def reap_once(settings: Settings) -> dict[str, Any]:
    store = RolloutStore(settings.redis_url, settings.key_prefix)
    queue = QueueClient(settings, celery_app(), store.redis)
    service = RolloutService(settings, store, environments(), queue)
    ended: dict[str, str] = {}
    try:
        now = time.time()
        failing = await _failing_hosts(settings, store, queue, now)
        for rollout_id in await store.live_ids():
            with rollout_context(rollout_id):
                reason = await _reap_one(service, rollout_id, failing, now)
            if reason is not None:
                ended[rollout_id] = reason
        await _recount_host_loads(store, service)
        hosts = [h["host"] for h in await queue.live_hosts()]
        for host in hosts:
            await queue.send("orchestrator.sweep_host", {}, queue=settings.host_queue(host))
        await queue.send("orchestrator.refill_pools", {}, queue=settings.shared_queue)
    finally:
        await store.close()
    return {"ended": ended, "hosts_swept": hosts, "hosts_failing": sorted(failing)}


async def _reap_one(
    service: RolloutService,
    rollout_id: str,
    failing: dict[str, tuple[str, str, dict[str, Any]]],
    now: float,
) -> str | None:
    """Fail the rollout if its host is failing; end it if it should end. Why it ended."""
    store = service.store
    rollout = await store.get(rollout_id)
    if rollout is None:
        await store.redis.zrem(store.key("rollouts", "live"), rollout_id)
        return None
    bind_sandbox(rollout.sandbox.sandbox_id if rollout.sandbox else None)
    host = rollout.sandbox.host if rollout.sandbox is not None else None
    host_cause = None
    if host in failing and rollout.state != RolloutState.INFRA_FAILED:
        host_cause, message, evidence = failing[host]
        await service.mark_infra_failed(rollout_id, host_cause, message, evidence)
        rollout = await store.get(rollout_id) or rollout
    end = reason_to_end(rollout, service, now)
    if end is None:
        return None
    if end.reason == EndReason.STUCK_CREATING:
        await service.mark_infra_failed(
            rollout_id, Cause.STUCK_CREATING, "sandbox never became ready", {}
        )
    await service.close(
        rollout_id, end.reason, wait=False, ended_by=_ENDED_BY_US.get(end.reason), why=end.why
    )
    if rollout.sandbox is not None:
        # A lost host's sandbox goes when the host's sweep runs again; it is reaped now.
        metrics.SANDBOXES_REAPED.labels(host_cause or end.reason).inc()
    return end.reason


async def _failing_hosts(
    settings: Settings, store: RolloutStore, queue: QueueClient, now: float
) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """Hosts whose rollouts cannot go on: silent for ``host_lost_after_s`` (first silence
    remembered in Redis, so the clock survives a beat restart), or whose daemon failed
    ``host_unhealthy_after`` probes in a row. Value: (cause, message, evidence)."""
    silent_key = store.key("hosts", "silent-since")
    failing: dict[str, tuple[str, str, dict[str, Any]]] = {}
    for host in sorted(str(h) for h in await store.redis.smembers(settings.hosts_key)):
        beat = await queue.heartbeat(host)
        if beat is None:
            await store.redis.hsetnx(silent_key, host, now)
            since = float(await store.redis.hget(silent_key, host) or now)
            if now - since > settings.host_lost_after_s:
                message = f"host {host!r} sent no heartbeat for {now - since:.0f} s"
                failing[host] = (Cause.HOST_LOST, message, {"silent_since": since})
            continue
        await store.redis.hdel(silent_key, host)
        if int(beat.get("docker_failures", 0)) >= settings.host_unhealthy_after:
            message = f"host {host!r} is unhealthy: {beat.get('error') or 'daemon probe failed'}"
            failing[host] = (Cause.HOST_UNHEALTHY, message, {"heartbeat": beat})
    for host, (cause, message, _) in failing.items():
        log.error("host.failing", host=host, cause=cause, error=message)
    return failing


def sweep_orphans(backend: SandboxBackend, client: redis.Redis, settings: Settings) -> int:
    """Destroy this host's sandboxes that no live rollout owns: its record is gone (Redis
    lost it), ended, or names another sandbox. Works from labels and Redis alone, so it
    cleans up after any crash, including a destroy that failed while the daemon was down.
    No age guard is needed: a rollout's record is written before its sandbox is created,
    and a record still creating names no sandbox, which spares it. Returns how many went."""
    destroyed = 0
    now = time.time()
    for handle in backend.list_owned():
        if not handle.rollout_id:
            continue  # ad hoc sandboxes (`orchestrator sandbox run`) go at their expiry
        rollout_id = handle.rollout_id
        if rollout_id == POOL_LABEL:
            pooled, owner = pool_owner(client, settings, handle.sandbox_id)
            # A young one may be on its way into its pool.
            if pooled or now - handle.created_at.timestamp() < pool_delivery_s(settings):
                continue
            rollout_id = owner or f"{POOL_LABEL}-unclaimed"
        key = f"{settings.key_prefix}rollout:{rollout_id}"
        state, sandbox, closed_at = client.hmget(key, ["state", "sandbox", "closed_at"])
        why = _orphaned(state, sandbox, closed_at, handle.sandbox_id)
        if why is None:
            continue
        metrics.ORPHANS_FOUND.inc()
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


def _orphaned(state: Any, sandbox: Any, closed_at: Any, sandbox_id: str) -> str | None:
    text = [v.decode() if isinstance(v, bytes) else v for v in (state, sandbox, closed_at)]
    state_s, sandbox_s, closed_s = text
    if state_s is None:
        return "no rollout record"
    if state_s in _ENDED or closed_s:
        # Just closed: the close's own destroy is on its way; racing it gains nothing.
        if closed_s and time.time() - float(closed_s) < RECENTLY_CLOSED_S:
            return None
        return f"rollout {state_s}"
    if sandbox_s and sandbox_s != "null":
        owner = json.loads(sandbox_s)
        if isinstance(owner, dict) and owner.get("sandbox_id") != sandbox_id:
            return "rollout owns another sandbox"
    return None


async def _recount_host_loads(store: RolloutStore, service: RolloutService) -> None:
    """Rebuild the per-host slot counts (rollouts/admission.py) from what holds slots:
    live rollouts with a host, ready pool sandboxes, and pool sandboxes in transit (being
    created, or handed out); so a count that drifted (a crash between taking a slot and
    using it) heals within one reaper pass."""
    counts: dict[str, int] = {}
    for rollout_id in await store.live_ids():
        rollout = await store.get(rollout_id)
        if rollout is not None and rollout.host is not None and rollout.closed_at is None:
            counts[rollout.host] = counts.get(rollout.host, 0) + 1
    for pool in targets(service.environments, service.settings):
        for raw in await store.redis.lrange(pool_key(service.settings, pool.name, "ready"), 0, -1):
            host = SandboxHandle.model_validate_json(raw).host
            counts[host] = counts.get(host, 0) + 1
    # Pool sandboxes being created, or taken and being probed, are in neither place yet:
    # without them a recount during a refill gave their slots away (a host overcommitted).
    for host, held in (await service.admission.in_transit()).items():
        counts[host] = counts.get(host, 0) + held
    await service.admission.set_loads(counts)
