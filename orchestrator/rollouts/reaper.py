"""The reaper (run by beat): ends rollouts that are idle, too old, or graded and past their
grace period, and has every live host sweep its expired sandboxes by label."""

from __future__ import annotations

import time
from typing import Any

from orchestrator.config import Settings
from orchestrator.queue.app import celery_app
from orchestrator.queue.client import QueueClient
from orchestrator.queue.worker import environments
from orchestrator.rollouts.models import RolloutState
from orchestrator.rollouts.service import RolloutService
from orchestrator.rollouts.store import Rollout, RolloutStore


def reason_to_end(rollout: Rollout, service: RolloutService, now: float) -> str | None:
    """Why this rollout should end now, or None to keep it."""
    if rollout.closed_at is not None:
        return None
    try:
        config = service.environments.get(rollout.environment)
    except LookupError:
        return "environment no longer configured"
    if rollout.state == RolloutState.INFRA_FAILED:
        return "infra_failed"
    if now - rollout.created_at > config.effective_lifetime_s(service.settings):
        return "max_lifetime"
    if rollout.state == RolloutState.GRADED and rollout.graded_at is not None:
        return "graded" if now - rollout.graded_at > config.grace_after_grade_s else None
    if rollout.state == RolloutState.CREATING:
        limit = service.settings.sandbox_create_timeout_s * 2
        return "stuck_creating" if now - rollout.created_at > limit else None
    if rollout.calls_in_flight <= 0 and now - rollout.last_activity > config.idle_timeout_s:
        return "idle"
    return None


async def reap_once(settings: Settings) -> dict[str, Any]:
    store = RolloutStore(settings.redis_url, settings.key_prefix)
    queue = QueueClient(settings, celery_app(), store.redis)
    service = RolloutService(settings, store, environments(), queue)
    ended: dict[str, str] = {}
    try:
        now = time.time()
        for rollout_id in await store.live_ids():
            rollout = await store.get(rollout_id)
            if rollout is None:
                await store.redis.zrem(store.key("rollouts", "live"), rollout_id)
                continue
            reason = reason_to_end(rollout, service, now)
            if reason is None:
                continue
            if reason == "stuck_creating":
                await service.mark_infra_failed(
                    rollout_id, "stuck_creating", "sandbox never became ready", {}
                )
            await service.close(rollout_id, reason, wait=False)
            ended[rollout_id] = reason
        await _recount_host_loads(store, queue)
        hosts = [h["host"] for h in await queue.live_hosts()]
        for host in hosts:
            queue.send("orchestrator.sweep_host", {}, queue=settings.host_queue(host))
    finally:
        await store.close()
    return {"ended": ended, "hosts_swept": hosts}


async def _recount_host_loads(store: RolloutStore, queue: QueueClient) -> None:
    """Rebuild the per-host rollout counts from the records, so a count that drifted (a
    crash between creating a sandbox and counting it) heals within one reaper pass."""
    counts: dict[str, int] = {}
    for rollout_id in await store.live_ids():
        rollout = await store.get(rollout_id)
        if rollout is not None and rollout.sandbox is not None and rollout.closed_at is None:
            counts[rollout.sandbox.host] = counts.get(rollout.sandbox.host, 0) + 1
    await queue.set_loads(counts)
