"""The deployment's state as Redis holds it: hosts, sandboxes, pools, queues, admission,
recent infrastructure failures. Read through the state package's readers (records,
heartbeats, admission, pools, queues), never from keys re-derived here."""

from __future__ import annotations

import time

from orchestrator.config import Settings
from orchestrator.environments.loader import EnvironmentRegistry
from orchestrator.state.admission import Admission
from orchestrator.state.errors import StateError
from orchestrator.state.heartbeat import Heartbeat
from orchestrator.state.models import RolloutState
from orchestrator.state.pools import (
    PoolClaims,
    PoolDemand,
    pool_name,
    pool_size,
    pooled_codebases,
)
from orchestrator.state.records import RolloutStore
from orchestrator.state.replies import QueueClient
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

NEWEST_LIVE = 20
"""Live rollouts a snapshot lists one by one (all are counted)."""


async def read_state(
    settings: Settings, store: RolloutStore, queue: QueueClient, registry: EnvironmentRegistry
) -> StatusSnapshot:
    """One snapshot of the deployment; a Redis that cannot be read gives ``redis_ok`` False
    and the error, not an exception (the status view keeps running through an outage)."""
    now = time.time()
    snapshot = StatusSnapshot(deployment=settings.deployment, taken_at=now, redis_ok=True)
    admission = Admission(settings, store.redis)
    try:
        live = await summaries(store, await store.live_ids())
        loads = await admission.loads()
        snapshot.hosts = await _hosts(store, queue, loads, live, now)
        snapshot.sandboxes = _sandboxes(live)
        snapshot.live_rollouts = len(live)
        snapshot.newest_live = sorted(live, key=lambda s: s.created_at, reverse=True)[:NEWEST_LIVE]
        snapshot.pools = await _pools(PoolClaims(settings, store.redis), registry)
        snapshot.sandboxes.pool_ready = sum(p.ready for p in snapshot.pools)
        snapshot.sandboxes.pool_creating = sum(p.creating for p in snapshot.pools)
        snapshot.queues = await _queues(queue, [h.host for h in snapshot.hosts])
        waiting = await admission.waiting(now)
        snapshot.admission = AdmissionView(
            waiting=int(waiting),
            slots_used=sum(max(0, n) for n in loads.values()),
            slots_total=sum(h.capacity or 0 for h in snapshot.hosts if h.alive),
        )
        snapshot.recent_failures = await store.recent_failures()
    except (StateError, OSError) as exc:
        snapshot.redis_ok = False
        snapshot.redis_error = f"{type(exc).__name__}: {exc}"
    return snapshot


async def _hosts(
    store: RolloutStore,
    queue: QueueClient,
    loads: dict[str, int],
    live: list[RolloutSummary],
    now: float,
) -> list[HostView]:
    known = set(await queue.heartbeats.known_hosts()) | set(loads)
    views = []
    for host in sorted(known):
        beat = await queue.heartbeats.get(host)
        rollouts = sum(1 for s in live if s.host == host)
        views.append(_host_view(host, beat, loads.get(host, 0), rollouts, now))
    return views


def _host_view(
    host: str, beat: Heartbeat | None, slots: int, rollouts: int, now: float
) -> HostView:
    if beat is None:
        return HostView(
            host=host,
            alive=False,
            healthy=False,
            schedulable=False,
            cordon_reasons=["no heartbeat"],
            slots_used=slots,
            live_rollouts=rollouts,
        )
    return HostView(
        host=host,
        alive=True,
        healthy=beat.backend_ok,
        schedulable=beat.schedulable,
        cordon_reasons=beat.cordon_reasons,
        draining=beat.draining,
        capacity=beat.capacity,
        slots_used=slots,
        sandboxes=beat.sandboxes,
        live_rollouts=rollouts,
        running_calls=beat.running_calls,
        backend_failures=beat.backend_failures,
        backend_ping_ms=beat.backend_ping_ms,
        disk_free_bytes=beat.disk_free_bytes,
        mem_available_bytes=beat.mem_available_bytes,
        heartbeat_age_s=max(0.0, now - beat.time),
        error=beat.error,
        daemon_cpu=beat.daemon_cpu,
    )


def _sandboxes(live: list[RolloutSummary]) -> SandboxCounts:
    counts = SandboxCounts()
    for summary in live:
        state = summary.state.value
        counts.rollouts_by_state[state] = counts.rollouts_by_state.get(state, 0) + 1
        if summary.state == RolloutState.ACTIVE and summary.host is not None:
            per_env = counts.active_by_host_environment.setdefault(summary.host, {})
            per_env[summary.environment] = per_env.get(summary.environment, 0) + 1
    return counts


def _configured_pools(
    registry: EnvironmentRegistry, settings: Settings, demand: dict[str, PoolDemand]
) -> dict[str, int]:
    """Pool name -> size now of every pool the environments ask for, demand-sized ones
    included (named as state/pools.targets names them, without asking the daemon)."""
    return {
        pool_name(name, codebase): pool_size(
            registry.get(name), settings, demand.get(pool_name(name, codebase))
        )
        for name in registry.names()
        for codebase in pooled_codebases(registry.get(name), settings, demand)
    }


async def _pools(pools: PoolClaims, registry: EnvironmentRegistry) -> list[PoolView]:
    configured = _configured_pools(registry, pools.settings, await pools.demand())
    # Pools no longer configured may still hold sandboxes: found by their keys.
    names = set(configured) | set(await pools.stocked())
    views = []
    for name in sorted(names):
        environment, _, codebase = name.partition(":")
        ready, creating = await pools.levels(name)
        views.append(
            PoolView(
                pool=name,
                environment=environment,
                codebase=None if codebase in ("", "-") else codebase,
                ready=ready,
                creating=creating,
                target=configured.get(name),
            )
        )
    return views


async def _queues(queue: QueueClient, hosts: list[str]) -> list[QueueDepth]:
    names = [queue.keys.shared_queue, *(queue.keys.host_queue(h) for h in hosts)]
    return [QueueDepth(queue=name, depth=await queue.depth(name)) for name in names]
