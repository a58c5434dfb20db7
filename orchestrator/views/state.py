"""The deployment's state as the status view shows it: hosts, sandboxes, pools, queues,
admission, recent infrastructure failures.

What the status view shares with the API's state gauges comes from the one read model,
state/snapshot.py's :class:`DeploymentState` (:func:`status_of`), so the two always agree;
only what the view alone shows is read beside it: the newest live rollouts' summaries, pools
no longer configured that still hold sandboxes, and the recent infrastructure failures.
"""

from __future__ import annotations

import asyncio
import time

from orchestrator.state.errors import StateError
from orchestrator.state.pools import PoolClaims
from orchestrator.state.records import RolloutStore
from orchestrator.state.snapshot import DeploymentState, HostState, LiveRollouts, StateReader
from orchestrator.views.models import (
    AdmissionView,
    HostView,
    PoolView,
    QueueDepth,
    RolloutSummary,
    SandboxCounts,
    StatusSnapshot,
)
from orchestrator.views.rollouts import summaries


async def read_state(reader: StateReader, store: RolloutStore) -> StatusSnapshot:
    """One snapshot of the deployment; a Redis that cannot be read gives ``redis_ok`` False
    and the error, not an exception (the status view keeps running through an outage)."""
    try:
        # The reader blocks (see state/snapshot.py): off the event loop.
        state = await asyncio.to_thread(reader.read)
        snapshot = status_of(state)
        snapshot.newest_live = await _newest(store, state.live.newest)
        _set_pools(snapshot, [*snapshot.pools, *await _unconfigured(reader, store, state)])
        snapshot.recent_failures = await store.recent_failures()
    except (StateError, OSError) as exc:
        return StatusSnapshot(
            deployment=reader.settings.deployment,
            taken_at=time.time(),
            redis_ok=False,
            redis_error=f"{type(exc).__name__}: {exc}",
        )
    return snapshot


def status_of(state: DeploymentState) -> StatusSnapshot:
    """What the status view shows of ``state``: all of it but the view's own reads (the
    newest live rollouts, pools no longer configured, recent failures)."""
    snapshot = StatusSnapshot(
        deployment=state.deployment,
        taken_at=state.taken_at,
        redis_ok=True,
        hosts=[_host_view(host, state) for host in state.hosts],
        sandboxes=_sandboxes(state.live),
        live_rollouts=state.live.count,
        queues=[QueueDepth(queue=queue, depth=depth) for queue, depth in state.queues.items()],
        admission=AdmissionView(
            waiting=state.admission_waiting,
            slots_used=state.slots_used,
            slots_total=state.slots_total,
            tenants=state.tenant_sandboxes,
        ),
    )
    pools = [
        PoolView(
            pool=pool.pool,
            environment=pool.environment,
            codebase=pool.codebase,
            ready=len(pool.ready),
            creating=pool.creating,
            target=pool.target,
        )
        for pool in state.pools
    ]
    _set_pools(snapshot, pools)
    return snapshot


def _host_view(host: HostState, state: DeploymentState) -> HostView:
    beat = host.heartbeat
    live = state.live.by_host.get(host.host, 0)
    if beat is None:
        return HostView(
            host=host.host,
            alive=False,
            healthy=False,
            schedulable=False,
            cordon_reasons=["no heartbeat"],
            slots_used=host.slots_used,
            live_rollouts=live,
        )
    return HostView(
        host=host.host,
        alive=True,
        healthy=beat.backend_ok,
        schedulable=beat.schedulable,
        cordon_reasons=beat.cordon_reasons,
        draining=beat.draining,
        capacity=beat.capacity,
        slots_used=host.slots_used,
        sandboxes=beat.sandboxes,
        live_rollouts=live,
        running_calls=beat.running_calls,
        backend_failures=beat.backend_failures,
        backend_ping_ms=beat.backend_ping_ms,
        disk_free_bytes=beat.disk_free_bytes,
        mem_available_bytes=beat.mem_available_bytes,
        heartbeat_age_s=max(0.0, state.taken_at - beat.time),
        error=beat.error,
        daemon_cpu=beat.daemon_cpu,
    )


def _sandboxes(live: LiveRollouts) -> SandboxCounts:
    return SandboxCounts(
        rollouts_by_state={state.value: n for state, n in live.by_state.items()},
        active_by_host_environment=live.active,
    )


def _set_pools(snapshot: StatusSnapshot, pools: list[PoolView]) -> None:
    snapshot.pools = sorted(pools, key=lambda p: p.pool)
    snapshot.sandboxes.pool_ready = sum(p.ready for p in snapshot.pools)
    snapshot.sandboxes.pool_creating = sum(p.creating for p in snapshot.pools)


async def _newest(store: RolloutStore, rollout_ids: list[str]) -> list[RolloutSummary]:
    """The summaries of the newest live rollouts (two round trips: their records and call
    counts, not every live rollout's)."""
    found = await summaries(store, rollout_ids)
    return sorted(found, key=lambda s: s.created_at, reverse=True)


async def _unconfigured(
    reader: StateReader, store: RolloutStore, state: DeploymentState
) -> list[PoolView]:
    """Pools no longer configured that still hold sandboxes (from the index of stocked
    pools), which the read model, made of the configured ones, leaves out."""
    claims = PoolClaims(reader.settings, store.redis)
    configured = {pool.pool for pool in state.pools}
    views = []
    for name in sorted(set(await claims.stocked()) - configured):
        environment, _, codebase = name.partition(":")
        ready, creating = await claims.levels(name)
        views.append(
            PoolView(
                pool=name,
                environment=environment,
                codebase=None if codebase in ("", "-") else codebase,
                ready=ready,
                creating=creating,
                target=None,
            )
        )
    return views
