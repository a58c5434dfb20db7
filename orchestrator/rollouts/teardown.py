"""The local stack's end (``orchestrator up`` stopping): every rollout whose sandbox it
holds is ended as the reaper ends one, so a trainer that comes back is told to discard it
(503 ``stack_stopped``), never handed a rollout whose sandbox is gone.

Only ``up`` does this, and only unless told to keep its sandboxes: a worker restarted in
production keeps its sandboxes and their rollouts (docs/failure-model.md). The records are
closed here with ``destroy=False``; the caller destroys the sandboxes itself once the
worker has stopped (orchestrator/local.py's :func:`end_sandboxes`), because the worker that
would take a destroy task is the one stopping.
"""

from __future__ import annotations

import asyncio

from orchestrator.config import Settings
from orchestrator.environments.loader import EnvironmentRegistry
from orchestrator.observability.logging import get_logger, rollout_context
from orchestrator.outcomes import Cause
from orchestrator.rollouts.service import RolloutService
from orchestrator.state.broker import celery_app
from orchestrator.state.records import Rollout, RolloutStore
from orchestrator.state.replies import WorkerClient

log = get_logger(__name__)

STOPPED_REASON = "stack_stopped"
"""The close reason of a rollout ended by the local stack's stop."""
_WHY = "the local stack (orchestrator up) that held its sandbox was stopped"
_PARALLEL = 16


def held_here(rollout: Rollout, host: str, other_hosts_alive: bool) -> bool:
    """Whether this host's stop ends ``rollout``: its sandbox is here, or it has none yet
    and no other host is beating that could be the one making it."""
    if rollout.closed_at is not None:
        return False
    if rollout.sandbox is not None:
        return rollout.sandbox.host == host
    return not other_hosts_alive


async def end_rollouts(settings: Settings, environments: EnvironmentRegistry) -> int:
    """Close every live rollout this host holds, ``ended_by`` :attr:`Cause.STACK_STOPPED`
    (a graded one keeps its score), its admission slot released, its sandbox left for the
    caller to destroy. Returns how many were ended."""
    store = RolloutStore.connect(settings, role="teardown")
    queue = WorkerClient(settings, celery_app(), store)
    service = RolloutService(settings, store, environments, queue)
    host = settings.host_id
    try:
        others = [b.host for b in await queue.heartbeats.live() if b.host != host]
        ended = 0
        gate = asyncio.Semaphore(_PARALLEL)

        async def end(rollout_id: str) -> bool:
            async with gate:
                with rollout_context(rollout_id):
                    rollout = await store.get(rollout_id)
                    if rollout is None:
                        await store.forget_live(rollout_id)
                        return False
                    if not held_here(rollout, host, bool(others)):
                        return False
                    await service.close(
                        rollout_id,
                        STOPPED_REASON,
                        ended_by=Cause.STACK_STOPPED,
                        why=_WHY,
                        destroy=False,
                    )
                    return True

        results = await asyncio.gather(*(end(r) for r in await store.live_ids()))
        ended = sum(results)
        log.info("stack.rollouts_ended", host=host, ended=ended, other_hosts=others)
        return ended
    finally:
        await store.close()
