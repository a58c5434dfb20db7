"""The deployment's state as one typed snapshot: the one read model of hosts, slots, live
rollouts, warm pools, queues and admission, behind both the API's state gauges
(state/collector.py) and ``orchestrator status`` (views/state.py), so the two never
disagree on a number they both show.

A read is three round trips whatever the number of hosts, pools and queues: the hosts set,
the slot counts and the pools' demand (they name the keys read next); then heartbeats, the
admission queue, the live set, every queue's lengths and every pool's ready list and
creations in one pipeline; then one pipelined ``HMGET`` per live rollout of the few fields
of its record read here (the only per-rollout read; no scan of the keyspace), skipped when
nothing is live.

The reader is synchronous (redis-py) on purpose: prometheus_client calls a collector
synchronously, in the thread a scrape of /metrics runs in (api/health.py), while the
status view runs in the CLI, where a thread (``asyncio.to_thread``) costs nothing. An async
reader would need an event loop, and with it a new connection, on every scrape.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter

import redis
from pydantic import BaseModel, Field

from orchestrator.config import Settings
from orchestrator.environments.loader import EnvironmentRegistry
from orchestrator.sandbox.backend import SandboxHandle
from orchestrator.state.connection import redis_client
from orchestrator.state.heartbeat import Heartbeat
from orchestrator.state.keys import Keys, queue_depth_keys
from orchestrator.state.models import RolloutState
from orchestrator.state.pool_sizing import (
    PoolDemand,
    parse_demand,
    pool_name,
    pool_size,
    pooled_codebases,
)

# A Redis that does not answer within this is reported down rather than stalling a reader.
_REDIS_TIMEOUT_S = 2.0

# The fields of a live rollout's record the snapshot reads (state/records.Rollout).
_LIVE_FIELDS = ["host", "environment", "state", "sandbox", "created_at"]

NEWEST = 20
"""Live rollouts a snapshot names one by one, the newest (all are counted)."""


class HostState(BaseModel):
    """One known worker host: one that ever beat, or one that holds slots."""

    host: str
    heartbeat: Heartbeat | None = Field(None, description="Its live heartbeat; None: silent.")
    capacity: int = Field(
        0,
        description="Sandboxes admission seats on it (state/admission.py): its heartbeat's "
        "capacity, else host_max_sandboxes; 0 while it is silent.",
    )
    slots_used: int = Field(0, description="Slots it holds, as the load hash counts them.")


class LiveRollouts(BaseModel):
    """The live rollouts, counted from the few fields of their records the snapshot reads.
    A rollout the live set names without a record (until the reaper takes it out) counts in
    ``count`` only."""

    count: int = Field(0, description="Rollouts in the live set.")
    by_state: dict[RolloutState, int] = Field(default_factory=dict)
    by_host: dict[str, int] = Field(
        default_factory=dict,
        description="host -> live rollouts whose record names it (its sandbox's host once "
        "it has one: rollouts/starts.py sets both together).",
    )
    holding: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description="host -> environment -> live rollouts with a sandbox recorded there.",
    )
    active: dict[str, dict[str, int]] = Field(
        default_factory=dict, description="host -> environment -> live rollouts ``active``."
    )
    newest: list[str] = Field(
        default_factory=list, description=f"The ids of the newest {NEWEST}, newest first."
    )


class PoolLevel(BaseModel):
    """One configured warm pool: its size now, its ready sandboxes, and those being made."""

    pool: str
    environment: str
    codebase: str | None = None
    target: int = Field(description="Its size now (state/pool_sizing.pool_size).")
    ready: list[SandboxHandle] = Field(default_factory=list)
    creating: int = 0


class DeploymentState(BaseModel):
    """The deployment's shared state at one moment, as Redis holds it."""

    deployment: str
    taken_at: float
    hosts: list[HostState] = Field(default_factory=list, description="In host order.")
    live: LiveRollouts = Field(default_factory=LiveRollouts)
    pools: list[PoolLevel] = Field(
        default_factory=list, description="Every configured pool, demand-sized ones included."
    )
    queues: dict[str, int] = Field(
        default_factory=dict,
        description="Celery messages waiting per queue (priority sub-queues included): the "
        "shared queue, then each known host's.",
    )
    admission_waiting: int = Field(0, description="New rollouts waiting for a slot.")
    tenant_sandboxes: dict[str, int] = Field(
        default_factory=dict,
        description="Sandboxes each tenant's rollouts hold or are making (state/quotas.py).",
    )
    reaper_last_pass: float | None = Field(
        None, description="When beat's reaper last finished a pass; None: never seen."
    )

    @property
    def beating(self) -> list[Heartbeat]:
        """The heartbeats of the hosts beating now, in host order."""
        return [h.heartbeat for h in self.hosts if h.heartbeat is not None]

    @property
    def slots_used(self) -> int:
        """Slots taken on the hosts beating now (a silent host seats nobody)."""
        return sum(max(0, h.slots_used) for h in self.hosts if h.heartbeat is not None)

    @property
    def slots_total(self) -> int:
        """The capacity of the hosts beating now."""
        return sum(h.capacity for h in self.hosts)

    def sandboxes_held(self) -> dict[tuple[str, str], int]:
        """(host, environment) -> sandboxes held there: those of live rollouts and the
        ready ones of warm pools."""
        held: Counter[tuple[str, str]] = Counter(
            {
                (host, environment): n
                for host, per_environment in self.live.holding.items()
                for environment, n in per_environment.items()
            }
        )
        for pool in self.pools:
            held.update((handle.host, pool.environment) for handle in pool.ready)
        return dict(held)


class StateReader:
    """Reads :class:`DeploymentState` from Redis on a blocking client of its own."""

    def __init__(
        self,
        settings: Settings,
        environments: EnvironmentRegistry,
        *,
        role: str = "metrics",
        client: redis.Redis | None = None,
    ) -> None:
        self.settings = settings
        self.environments = environments
        self.keys = Keys.of(settings.deployment)
        self.client = client or redis_client(
            settings.redis_url,
            socket_timeout=_REDIS_TIMEOUT_S,
            socket_connect_timeout=_REDIS_TIMEOUT_S,
            decode_responses=True,
            client_name=self.keys.client_name(role),
        )

    def close(self) -> None:
        self.client.close()

    def read(self) -> DeploymentState:
        """One snapshot, in three round trips (two when nothing is live); Redis's own
        error (state/errors.StateError) when it cannot be read."""
        keys = self.keys
        first = self.client.pipeline(transaction=False)
        first.smembers(keys.hosts)
        first.hgetall(keys.load)
        first.hgetall(keys.pool_demand)
        first.get(keys.reaper_pass)
        first.smembers(keys.tenants_seen)
        members, loads, demand, reaper_pass, seen = first.execute()
        tenants = sorted(str(t) for t in seen)
        slots = {str(h): int(n) for h, n in loads.items()}
        hosts = sorted({str(h) for h in members} | set(slots))
        pools = self._configured_pools(parse_demand(demand))
        queues = [keys.shared_queue, *(keys.host_queue(h) for h in hosts)]
        now = time.time()
        pipe = self.client.pipeline(transaction=False)
        if hosts:
            pipe.mget([keys.heartbeat(h) for h in hosts])
        pipe.zcount(keys.waiting, now, "+inf")
        pipe.zrange(keys.live, 0, -1)
        for queue in queues:
            for key in queue_depth_keys(queue):
                pipe.llen(key)
        for pool in pools:
            pipe.lrange(keys.pool(pool.pool, "ready"), 0, -1)
            pipe.get(keys.pool(pool.pool, "pending"))
        for tenant in tenants:
            pipe.zcard(keys.tenant_sandboxes(tenant))
        replies = iter(pipe.execute())
        raw_beats: list[str | None] = next(replies) if hosts else []
        waiting = int(next(replies))
        live = self._live([str(i) for i in next(replies)])
        depths = {q: sum(int(next(replies)) for _ in queue_depth_keys(q)) for q in queues}
        for pool in pools:
            pool.ready = [SandboxHandle.model_validate_json(raw) for raw in next(replies)]
            pool.creating = max(0, int(next(replies) or 0))
        held = {tenant: int(next(replies)) for tenant in tenants}
        return DeploymentState(
            deployment=self.settings.deployment,
            taken_at=now,
            hosts=[
                self._host(host, raw, slots.get(host, 0))
                for host, raw in zip(hosts, raw_beats, strict=True)
            ],
            live=live,
            pools=pools,
            queues=depths,
            admission_waiting=waiting,
            reaper_last_pass=float(reaper_pass) if reaper_pass else None,
            tenant_sandboxes=held,
        )

    def _host(self, host: str, raw_beat: str | None, slots: int) -> HostState:
        if not raw_beat:
            return HostState(host=host, slots_used=slots)
        beat = Heartbeat.model_validate_json(raw_beat)
        return HostState(
            host=host,
            heartbeat=beat,
            capacity=beat.capacity or self.settings.host_max_sandboxes,
            slots_used=slots,
        )

    def _live(self, rollout_ids: list[str]) -> LiveRollouts:
        """Counted here, not kept one by one: a scrape with thousands live makes no object
        per rollout."""
        if not rollout_ids:
            return LiveRollouts()
        pipe = self.client.pipeline(transaction=False)
        for rollout_id in rollout_ids:
            # The command as is: redis-py's hmget() wrapper costs 3 ms more per 1000.
            pipe.execute_command(  # type: ignore[no-untyped-call]
                "HMGET", self.keys.rollout(rollout_id), *_LIVE_FIELDS
            )
        records: list[list[str | None]] = pipe.execute()
        hosted = [(r[0], r[1] or "", r[2], r[3]) for r in records if r[0]]
        # A record whose sandbox is not made yet keeps it as JSON null.
        holding = Counter((h, e) for h, e, _, sandbox in hosted if sandbox and sandbox != "null")
        active = Counter((h, e) for h, e, state, _ in hosted if state == RolloutState.ACTIVE)
        created = ((float(r[4]), i) for i, r in zip(rollout_ids, records, strict=True) if r[4])
        return LiveRollouts(
            count=len(rollout_ids),
            by_state={
                RolloutState(state): n
                for state, n in Counter(r[2] for r in records if r[2]).items()
            },
            by_host=Counter(h for h, _, _, _ in hosted),
            holding=_nested(holding),
            active=_nested(active),
            newest=[rollout_id for _, rollout_id in heapq.nlargest(NEWEST, created)],
        )

    def _configured_pools(self, demand: dict[str, PoolDemand]) -> list[PoolLevel]:
        """Every pool the environments ask for now, demand-sized ones included (named as
        state/pool_sizing.targets names them, without resolving their images), in name order."""
        pools = []
        for name in self.environments.names():
            env = self.environments.get(name)
            for codebase in pooled_codebases(env, self.settings, demand):
                pool = pool_name(name, codebase)
                target = pool_size(env, self.settings, demand.get(pool))
                pools.append(
                    PoolLevel(pool=pool, environment=name, codebase=codebase, target=target)
                )
        return sorted(pools, key=lambda p: p.pool)


def _nested(counts: Counter[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """(host, environment) -> n as host -> environment -> n."""
    nested: dict[str, dict[str, int]] = {}
    for (host, environment), n in counts.items():
        nested.setdefault(host, {})[environment] = n
    return nested
