"""The deployment's state as Redis holds it: hosts, sandboxes, pools, queues, admission,
recent infrastructure failures. Read with the key helpers of the modules that write them
(rollouts/store.py, pools.py, admission.py, queue/client.py), never re-derived here."""

from __future__ import annotations

import time
from typing import Any

from redis.exceptions import RedisError

from orchestrator.config import Settings
from orchestrator.environments.loader import EnvironmentRegistry
from orchestrator.queue.app import queue_depth_keys
from orchestrator.queue.client import QueueClient
from orchestrator.rollouts.admission import load_key, waiting_key
from orchestrator.rollouts.models import RolloutState
from orchestrator.rollouts.pools import pool_key, pool_name, pooled_codebases
from orchestrator.rollouts.store import RolloutStore
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
    try:
        live = await summaries(store, await store.live_ids())
        loads = {str(k): int(v) for k, v in (await store.redis.hgetall(load_key(settings))).items()}
        snapshot.hosts = await _hosts(store, queue, loads, live, now)
        snapshot.sandboxes = _sandboxes(live)
        snapshot.live_rollouts = len(live)
        snapshot.newest_live = sorted(live, key=lambda s: s.created_at, reverse=True)[:NEWEST_LIVE]
        snapshot.pools = await _pools(settings, store, registry)
        snapshot.sandboxes.pool_ready = sum(p.ready for p in snapshot.pools)
        snapshot.sandboxes.pool_creating = sum(p.creating for p in snapshot.pools)
        snapshot.queues = await _queues(settings, store, [h.host for h in snapshot.hosts])
        waiting = await store.redis.zcount(waiting_key(settings), now, "+inf")
        snapshot.admission = AdmissionView(
            waiting=int(waiting),
            slots_used=sum(max(0, n) for n in loads.values()),
            slots_total=sum(h.capacity or 0 for h in snapshot.hosts if h.alive),
        )
        snapshot.recent_failures = await store.recent_failures()
    except (RedisError, OSError) as exc:
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
    known = {str(h) for h in await store.redis.smembers(queue.settings.hosts_key)} | set(loads)
    views = []
    for host in sorted(known):
        beat = await queue.heartbeat(host)
        rollouts = sum(1 for s in live if s.host == host)
        views.append(_host_view(host, beat, loads.get(host, 0), rollouts, now))
    return views


def _host_view(
    host: str, beat: dict[str, Any] | None, slots: int, rollouts: int, now: float
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
    sent = beat.get("time")
    return HostView(
        host=host,
        alive=True,
        healthy=bool(beat.get("docker_ok")),
        schedulable=bool(beat.get("schedulable")),
        cordon_reasons=list(beat.get("cordon_reasons") or []),
        draining=bool(beat.get("draining")),
        capacity=beat.get("capacity"),
        slots_used=slots,
        sandboxes=beat.get("sandboxes"),
        live_rollouts=rollouts,
        running_calls=int(beat.get("running_calls") or 0),
        docker_failures=int(beat.get("docker_failures") or 0),
        docker_ping_ms=beat.get("docker_ping_ms"),
        disk_free_bytes=beat.get("disk_free_bytes"),
        mem_available_bytes=beat.get("mem_available_bytes"),
        heartbeat_age_s=max(0.0, now - float(sent)) if sent is not None else None,
        error=beat.get("error"),
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


def _configured_pools(registry: EnvironmentRegistry) -> dict[str, int]:
    """Pool name -> size of every pool the environments ask for (named as
    rollouts/pools.targets names them, without asking the daemon)."""
    return {
        pool_name(name, codebase): registry.get(name).pool_size
        for name in registry.names()
        for codebase in pooled_codebases(registry.get(name))
    }


async def _pools(
    settings: Settings, store: RolloutStore, registry: EnvironmentRegistry
) -> list[PoolView]:
    configured = _configured_pools(registry)
    names = set(configured)
    # Pools no longer configured may still hold sandboxes: find them by their keys.
    head, tail = pool_key(settings, "", "ready").split("::")
    async for key in store.redis.scan_iter(match=pool_key(settings, "*", "ready"), count=500):
        names.add(str(key).removeprefix(head + ":").removesuffix(":" + tail))
    views = []
    for name in sorted(names):
        environment, _, codebase = name.partition(":")
        async with store.redis.pipeline(transaction=False) as pipe:
            pipe.llen(pool_key(settings, name, "ready"))
            pipe.get(pool_key(settings, name, "pending"))
            ready, pending = await pipe.execute()
        views.append(
            PoolView(
                pool=name,
                environment=environment,
                codebase=None if codebase in ("", "-") else codebase,
                ready=int(ready),
                creating=max(0, int(pending or 0)),
                target=configured.get(name),
            )
        )
    return views


async def _queues(settings: Settings, store: RolloutStore, hosts: list[str]) -> list[QueueDepth]:
    names = [settings.shared_queue, *(settings.host_queue(h) for h in hosts)]
    depths = []
    for name in names:
        async with store.redis.pipeline(transaction=False) as pipe:
            for key in queue_depth_keys(name):
                pipe.llen(key)
            sizes = await pipe.execute()
        depths.append(QueueDepth(queue=name, depth=sum(int(s) for s in sizes)))
    return depths
