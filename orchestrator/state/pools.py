"""Warm pools: ready sandboxes per (environment, codebase), so a new rollout at a training
step's boundary takes one in a single Redis operation instead of waiting for a cold start.

Keys (state/keys.py), per pool ``<environment>:<codebase or ->``: its ready list (handles of
ready, unused sandboxes) and pending counter (sandboxes a worker is creating for it right
now); deployment-wide, the pool members (not yet bound to a rollout: the sweep spares
them), each taken sandbox's claim (the rollout that took it: the sweep checks it), and the
slots in transit of pool sandboxes being created or handed out (state/admission.py), which
the reaper's slot recount adds.

A pool's size follows demand (state/pool_sizing.py, the policy); a pool bigger than its
size is trimmed (:meth:`PoolFiller.trim`), so pools shrink when demand falls.

A pool sandbox serves one rollout at a time: when that rollout ends it is destroyed, or
reset and returned here (recycling: rollouts/recycling.py). While it is being reset it is
in the pool's recycling set, and a new rollout that finds the pool empty waits for it
(:meth:`PoolClaims.take_recycled`, one waiter per reset) rather than making a cold one
beside it. It holds its host's
admission slot (state/admission.py) from creation, and hands it to its rollout. Workers
fill pools (queue/handlers.refill_pools: on every reaper pass, and after every claim); the
API claims with LPOP and probes the sandbox before handing it out.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis

from orchestrator.config import Settings
from orchestrator.environments.loader import ResolvedEnvironment
from orchestrator.observability import metrics
from orchestrator.sandbox.backend import CommitWorkspace, SandboxHandle
from orchestrator.state.admission import TAKE_SLOT, TRANSIT_MAX_S, transit_member
from orchestrator.state.connection import redis_client
from orchestrator.state.keys import Keys
from orchestrator.state.pool_sizing import (
    POOL_LABEL,
    PoolDemand,
    PoolTarget,
    autosized,
    next_demand,
    parse_demand,
    peak_concurrency,
    pool_name,
)
from orchestrator.state.records import Rollout

# KEYS: ready list, pending counter. ARGV: pool size, wanted. Reserves up to ``wanted``
# creations so that ready + pending never exceeds the size, however many fillers run.
_RESERVE = """
local have = redis.call('LLEN', KEYS[1]) + tonumber(redis.call('GET', KEYS[2]) or '0')
local n = math.min(tonumber(ARGV[2]), tonumber(ARGV[1]) - have)
if n <= 0 then return 0 end
redis.call('INCRBY', KEYS[2], n)
redis.call('EXPIRE', KEYS[2], 600)
return n
"""

# KEYS: ready list, pending counter, members set, slots in transit, stocked pools set.
# ARGV: handle JSON ('' when the creation failed), sandbox id, the creation's transit
# member, pool name. One step, so the sandbox's slot is always counted in one place: in
# transit, then in the ready list; and a ready list never exists unindexed. A sandbox in a
# pool already is not put there again (two rollouts would take it).
_DELIVER = """
if ARGV[1] ~= '' and redis.call('SADD', KEYS[3], ARGV[2]) == 1 then
  redis.call('RPUSH', KEYS[1], ARGV[1])
  redis.call('SADD', KEYS[5], ARGV[4])
end
if tonumber(redis.call('DECR', KEYS[2])) < 0 then redis.call('SET', KEYS[2], 0) end
redis.call('ZREM', KEYS[4], ARGV[3])
return 1
"""

# KEYS: ready list, slots in transit. ARGV: until when to count the slot in transit. Takes
# a ready sandbox and counts its slot in transit in one step (until bound or discarded).
_TAKE = """
local raw = redis.call('LPOP', KEYS[1])
if not raw then return false end
local handle = cjson.decode(raw)
redis.call('ZADD', KEYS[2], ARGV[1], handle['host'] .. '|' .. handle['sandbox_id'])
return raw
"""


# KEYS: stocked pools set, the pool's ready list. ARGV: pool name. Unindexes a pool whose
# ready list is gone (its last sandbox taken), unless a delivery made it again meanwhile.
_UNSTOCK = """
if redis.call('EXISTS', KEYS[2]) == 0 then return redis.call('SREM', KEYS[1], ARGV[1]) end
return 0
"""


# KEYS: the pool's recycling set, its awaiting count. ARGV: now. A new rollout that found
# its pool empty may wait for a sandbox being recycled for it, one waiter per sandbox in
# reset: more waiters than resets would wait for nothing and make their cold creates late.
# Returns 1 when the caller is counted as a waiter.
_AWAIT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local resetting = redis.call('ZCARD', KEYS[1])
if tonumber(redis.call('GET', KEYS[2]) or '0') >= resetting then return 0 end
redis.call('INCR', KEYS[2])
redis.call('EXPIRE', KEYS[2], 60)
return 1
"""

# KEYS: ready list, slots in transit, recycling set. ARGV: until when to count the slot in
# transit, now. A ready sandbox (as _TAKE), else 1 while a sandbox is still being reset
# for the pool, else 0: a waiter's poll in one round trip.
_TAKE_OR_WAIT = """
local raw = redis.call('LPOP', KEYS[1])
if raw then
  local handle = cjson.decode(raw)
  redis.call('ZADD', KEYS[2], ARGV[1], handle['host'] .. '|' .. handle['sandbox_id'])
  return raw
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[2])
if redis.call('ZCARD', KEYS[3]) > 0 then return 1 end
return 0
"""


class RecycleWait(StrEnum):
    """How a rollout's wait for a sandbox being reset for its pool ended (the ``result`` of
    orchestrator_pool_recycle_wait_seconds)."""

    TAKEN = "taken"
    NONE_LEFT = "none_left"  # the resets ended without one for it
    TIMED_OUT = "timed_out"  # pool_recycle_wait_s passed


RECYCLING_MAX_S = 120.0
"""A sandbox in a pool's recycling set for longer than this is not waited for any more (its
worker died with the reset queued: the sweep destroys it)."""

RECYCLE_POLL_S = 0.05
"""How often a rollout waiting for a recycled sandbox looks for it (a reset takes 0.2 s
and more; a poll is one Lua step)."""

# KEYS: a pool's count of sandboxes out with rollouts (or of its waiters). One fewer, never
# below 0.
_RETURNED = """
if tonumber(redis.call('GET', KEYS[1]) or '0') > 0 then return redis.call('DECR', KEYS[1]) end
return 0
"""

# KEYS: a pool's count of sandboxes out with rollouts, the deployment's count of claims and
# returns. The first one fewer (never below 0), the second one more.
_RETURNED_OUT = """
redis.call('INCR', KEYS[2])
if tonumber(redis.call('GET', KEYS[1]) or '0') > 0 then return redis.call('DECR', KEYS[1]) end
return 0
"""

# KEYS: the count of claims and returns, then each pool's count of sandboxes out. ARGV: that
# count as the reaper read it before it read the live rollouts ('' for none), the TTL, then
# each pool's recount. The recount is what the rollouts the reaper read hold: a claim or a
# return since then is not in it (a claim comes before its rollout's record), so it is set
# only when none came; else each count keeps its own value, its TTL renewed.
_RECOUNT = """
local unchanged = (redis.call('GET', KEYS[1]) or '') == ARGV[1]
for i = 2, #KEYS do
  if unchanged then
    redis.call('SET', KEYS[i], ARGV[i + 1], 'EX', ARGV[2])
  else
    redis.call('EXPIRE', KEYS[i], ARGV[2])
  end
end
return unchanged and 1 or 0
"""

# KEYS: ready list, members set. ARGV: size. Takes out the newest ready sandboxes past the
# size, for the caller to destroy (LPOP claims take the oldest, so a claim never races it).
_TRIM = """
local out = {}
while redis.call('LLEN', KEYS[1]) > tonumber(ARGV[1]) do
  local raw = redis.call('RPOP', KEYS[1])
  local handle = cjson.decode(raw)
  redis.call('SREM', KEYS[2], handle['sandbox_id'])
  table.insert(out, raw)
end
return out
"""


def _known_workspace(demand: PoolDemand | None) -> CommitWorkspace | None:
    return demand.workspace if demand is not None else None


class PoolFiller:
    """The worker's side: top pools up to their size (see queue/handlers.refill_pools)."""

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.settings = settings
        self.client = client
        self.keys = Keys.of(settings.deployment)
        self._reserve = client.register_script(_RESERVE)
        self._deliver = client.register_script(_DELIVER)
        self._take_slot = client.register_script(TAKE_SLOT)
        self._trim = client.register_script(_TRIM)

    def awaited(self, pool: str) -> bool:
        """Whether a new rollout waits for a sandbox being reset for ``pool``."""
        return int(self.client.get(self.keys.pool(pool, "awaiting")) or 0) > 0

    def demand(self) -> dict[str, PoolDemand]:
        """Every pool's recent demand (one round trip), for :func:`targets`."""
        return parse_demand(self.client.hgetall(self.keys.pool_demand))

    def trim(self, pool: PoolTarget) -> list[SandboxHandle]:
        """Take out of the pool the ready sandboxes past its size (its demand fell); the
        caller destroys them and releases their slots."""
        raws = self._trim(
            keys=[self.keys.pool(pool.name, "ready"), self.keys.pool_members], args=[pool.size]
        )
        return [SandboxHandle.model_validate_json(raw) for raw in raws]

    def reserve(self, pool: PoolTarget, wanted: int, size: int | None = None) -> int:
        """How many sandboxes this filler may add to ``pool`` now (``size``: the pool's
        size to fill up to, default its own)."""
        keys = [self.keys.pool(pool.name, "ready"), self._pending(pool)]
        limit = pool.size if size is None else size
        return int(self._reserve(keys=keys, args=[limit, wanted]))

    def refill_size(self, pool: PoolTarget) -> int:
        """What a refill fills ``pool`` up to: its size, less the sandboxes its rollouts
        hold and those being reset for it, which come back to it (recycling), so a refill
        does not make sandboxes that the rollouts' own, reset, would find no room beside."""
        if not pool.recycles:
            return pool.size
        with self.client.pipeline(transaction=False) as pipe:
            pipe.get(self.keys.pool(pool.name, "out"))
            pipe.zcount(self.keys.pool(pool.name, "recycling"), time.time(), "+inf")
            out, resetting = pipe.execute()
        return max(0, pool.size - int(out or 0) - int(resetting))

    def take_slot(self, tag: str) -> str | None:
        """A slot of this host's capacity for a pool creation, counted in transit in the
        same step (the reaper's recount sees it before the sandbox reaches the ready
        list); the transit member to give :meth:`deliver`, None when the host is full."""
        host, capacity = self.settings.host_id, self.settings.host_max_sandboxes
        now = time.time()
        # Not in the admission queue: a refill never takes a slot a waiting rollout wants.
        # Not in the queue, no tenant: a refill never takes a slot a rollout waits for.
        taken = self._take_slot(
            keys=[self.keys.load, self.keys.transit, self.keys.waiting, self.keys.waiting_tenants],
            args=[tag, now + TRANSIT_MAX_S, "", now, "", self.keys.tenant_prefix, host, capacity],
        )
        return transit_member(host, tag) if taken else None

    def deliver(self, pool: PoolTarget, handle: SandboxHandle | None, transit: str = "") -> None:
        """Put a new sandbox in the pool (None: its creation failed, free the reservation),
        and stop counting its slot in transit."""
        self._deliver(
            keys=[
                self.keys.pool(pool.name, "ready"),
                self._pending(pool),
                self.keys.pool_members,
                self.keys.transit,
                self.keys.pools_stocked,
            ],
            args=[
                handle.model_dump_json() if handle else "",
                handle.sandbox_id if handle else "",
                transit,
                pool.name,
            ],
        )

    def recycled(self, pool: str, sandbox_id: str) -> None:
        """The reset of a sandbox sent back to ``pool`` is over (it is in the pool, or
        destroyed): no new rollout waits for it any more."""
        self.client.zrem(self.keys.pool(pool, "recycling"), sandbox_id)

    def prune(self, pool: PoolTarget, *, min_left_s: float) -> list[SandboxHandle]:
        """Take out of the pool the sandboxes with less than ``min_left_s`` before their
        expiry (a rollout could outlive them); the caller destroys them."""
        key = self.keys.pool(pool.name, "ready")
        stale = []
        now = time.time()
        for raw in self.client.lrange(key, 0, -1):
            handle = SandboxHandle.model_validate_json(raw)
            if handle.expires_at.timestamp() - now >= min_left_s:
                continue
            if self.client.lrem(key, 1, str(raw, "utf-8") if isinstance(raw, bytes) else raw):
                # (else a rollout took it just now)
                self.client.srem(self.keys.pool_members, handle.sandbox_id)
                stale.append(handle)
        return stale

    def forget_missing(self, pool: PoolTarget, host: str, live: set[str]) -> int:
        """Drop entries naming sandboxes of ``host`` that no longer exist (the host
        restarted, or Redis outlived a wipe of the daemon): a pool full of dead entries
        would never refill."""
        key = self.keys.pool(pool.name, "ready")
        dropped = 0
        for raw in self.client.lrange(key, 0, -1):
            handle = SandboxHandle.model_validate_json(raw)
            if handle.host != host or handle.sandbox_id in live:
                continue
            text = str(raw, "utf-8") if isinstance(raw, bytes) else raw
            if self.client.lrem(key, 1, text):
                self.client.srem(self.keys.pool_members, handle.sandbox_id)
                dropped += 1
        return dropped

    def _pending(self, pool: PoolTarget) -> str:
        return self.keys.pool(pool.name, "pending")


@dataclass(frozen=True)
class PoolStanding:
    """What Redis says of one sandbox a pool may have held (its labels cannot: they name the
    rollout it was made for, fixed at its creation, and a recycled sandbox outlives it)."""

    pooled: bool
    """It lies in a pool, or is on its way back to one (being recycled)."""
    recycling: bool
    """On its way back: being reset, its slot held in transit (Admission.hold_for_recycling)."""
    claimed_by: str
    """The rollout that last took it from a pool, or ''."""

    def owner(self, label: str) -> str:
        """Who holds it now: ``pool``, or a rollout id; ``label`` is the rollout its labels
        name (its first owner), which is the answer only when no pool ever had it."""
        if self.pooled:
            return POOL_LABEL
        return self.claimed_by or label


def pool_standings(
    client: redis.Redis, keys: Keys, handles: list[SandboxHandle]
) -> list[PoolStanding]:
    """:class:`PoolStanding` of each of ``handles``, in order, in one round trip."""
    pipe = client.pipeline(transaction=False)
    for handle in handles:
        pipe.sismember(keys.pool_members, handle.sandbox_id)
        pipe.get(keys.pool_claim(handle.sandbox_id))
        pipe.zscore(keys.transit, transit_member(handle.host, f"recycle:{handle.sandbox_id}"))
    replies = pipe.execute() if handles else []
    now = time.time()
    standings = []
    for at in range(0, len(replies), 3):
        member, claim, recycling_until = replies[at : at + 3]
        recycling = recycling_until is not None and float(recycling_until) > now
        claimed = claim.decode() if isinstance(claim, bytes) else (claim or "")
        standings.append(PoolStanding(bool(member) or recycling, recycling, str(claimed)))
    return standings


def read_pool_standings(
    settings: Settings, handles: list[SandboxHandle], *, timeout_s: float = 2.0
) -> list[PoolStanding]:
    """:func:`pool_standings` on a connection of its own (the CLI's), given up after
    ``timeout_s``; Redis's own error (state/errors.StateError) when it cannot be read."""
    keys = Keys.of(settings.deployment)
    client = redis_client(
        settings.redis_url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        client_name=keys.client_name("cli"),
    )
    try:
        return pool_standings(client, keys, handles)
    finally:
        client.close()


class PoolClaims:
    """The API's side: take a ready sandbox from a pool in one Redis operation."""

    def __init__(self, settings: Settings, client: Any) -> None:
        self.settings = settings
        self.client = client  # redis.asyncio.Redis with decoded responses
        self.keys = Keys.of(settings.deployment)
        self._take = client.register_script(_TAKE)
        self._returned = client.register_script(_RETURNED)
        self._returned_out = client.register_script(_RETURNED_OUT)
        self._recount = client.register_script(_RECOUNT)
        self._await = client.register_script(_AWAIT)
        self._take_or_wait = client.register_script(_TAKE_OR_WAIT)
        self._unstock = client.register_script(_UNSTOCK)
        # Three reaper passes: the reaper counts what a pool's rollouts hold on each.
        self._out_ttl_s = max(30, int(3 * settings.reaper_interval_s))

    async def take(self, resolved: ResolvedEnvironment) -> SandboxHandle | None:
        """A ready sandbox of this rollout's pool, or None (no pool, or empty). The caller
        checks it (expiry, a probe) and binds it to the rollout or destroys it."""
        if resolved.environment.pool_size <= 0 and not autosized(
            resolved.environment, self.settings
        ):
            return None
        name = pool_name(resolved.environment.name, resolved.codebase)
        keys = [self.keys.pool(name, "ready"), self.keys.transit]
        raw = await self._take(keys=keys, args=[time.time() + TRANSIT_MAX_S])
        return None if raw is None else await self._claimed(name, raw)

    async def take_recycled(
        self, resolved: ResolvedEnvironment, wait_s: float
    ) -> SandboxHandle | None:
        """For a rollout that found its pool empty: a sandbox of the pool that is being
        reset (recycled from a rollout that ended), once it is back, waiting at most
        ``wait_s``; None at once when no reset is under way that another waiter has not
        counted on, or when the resets end without one for us."""
        name = pool_name(resolved.environment.name, resolved.codebase)
        recycling, awaiting = self.keys.pool(name, "recycling"), self.keys.pool(name, "awaiting")
        keys = [self.keys.pool(name, "ready"), self.keys.transit, recycling]
        if wait_s <= 0:
            return None
        if not await self._await(keys=[recycling, awaiting], args=[time.time()]):
            # No reset under way now; one may have ended since the caller found the pool
            # empty, its sandbox delivered before the reset stopped counting (the worker
            # delivers first): taken here, or the rollout would make a cold one beside it.
            raw = await self._take_or_wait(
                keys=keys, args=[time.time() + TRANSIT_MAX_S, time.time()]
            )
            return await self._claimed(name, raw) if isinstance(raw, str) else None
        started = time.monotonic()
        result, handle = RecycleWait.TIMED_OUT, None
        try:
            while time.monotonic() - started < wait_s:
                await asyncio.sleep(RECYCLE_POLL_S)
                raw = await self._take_or_wait(
                    keys=keys, args=[time.time() + TRANSIT_MAX_S, time.time()]
                )
                if isinstance(raw, str):
                    result, handle = RecycleWait.TAKEN, await self._claimed(name, raw)
                    break
                if not raw:
                    result = RecycleWait.NONE_LEFT
                    break
        finally:
            await self._returned(keys=[awaiting])
            metrics.RECYCLE_WAITS.labels(result).observe(time.monotonic() - started)
        return handle

    async def recycling(self, pool: str, sandbox_id: str) -> None:
        """A sandbox is on its way back to ``pool`` (sent for reset): new rollouts that find
        the pool empty may wait for it (:meth:`take_recycled`). The worker's
        :meth:`PoolFiller.recycled` ends it; a reset that never ends stops counting after
        :data:`RECYCLING_MAX_S`."""
        key = self.keys.pool(pool, "recycling")
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.zadd(key, {sandbox_id: time.time() + RECYCLING_MAX_S})
            pipe.expire(key, int(RECYCLING_MAX_S))
            await pipe.execute()

    async def _claimed(self, name: str, raw: str) -> SandboxHandle:
        # Out with its rollout until the reaper's next count (record_demand); a count no
        # pass corrects (its rollouts were all gone before one came) lapses on its own.
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.incr(self.keys.pool(name, "out"))
            pipe.expire(self.keys.pool(name, "out"), self._out_ttl_s)
            pipe.incr(self.keys.pools_out_changes)
            await pipe.execute()
        # Still a pool member (the orphan sweep spares it), and its slot in transit (the
        # recount keeps it), until bound to its rollout.
        return SandboxHandle.model_validate_json(raw)

    async def returned(self, environment: str, codebase: str | None) -> None:
        """A rollout that took a sandbox from this pool ended: one fewer out with rollouts."""
        out = self.keys.pool(pool_name(environment, codebase), "out")
        await self._returned_out(keys=[out, self.keys.pools_out_changes])

    async def out_changes(self) -> str:
        """The count of claims and returns so far ('' for none): the reaper reads it
        before the live rollouts, for :meth:`record_demand`."""
        return str(await self.client.get(self.keys.pools_out_changes) or "")

    async def bind(self, handle: SandboxHandle, rollout_id: str, ttl_s: int) -> None:
        """From now on the sandbox is ``rollout_id``'s (and the sweep judges it by it)."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.pool_claim(handle.sandbox_id), rollout_id, ex=ttl_s)
            pipe.srem(self.keys.pool_members, handle.sandbox_id)
            # The rollout's record (its host set) counts the slot from now on.
            pipe.zrem(self.keys.transit, self._in_transit(handle))
            await pipe.execute()

    async def forget(self, handle: SandboxHandle) -> None:
        """The sandbox taken is being destroyed instead of bound (its slot is released)."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.srem(self.keys.pool_members, handle.sandbox_id)
            pipe.zrem(self.keys.transit, self._in_transit(handle))
            await pipe.execute()

    async def demand(self) -> dict[str, PoolDemand]:
        """Every pool's recent demand (one round trip), for :func:`targets`."""
        return parse_demand(await self.client.hgetall(self.keys.pool_demand))

    async def record_demand(
        self,
        live: list[tuple[str, str | None]],
        recent: list[Rollout] | None = None,
        out_changes: str | None = None,
    ) -> None:
        """The reaper's pass: the (environment, codebase) of every live rollout, and
        ``recent``, the records of the rollouts live at some moment since the last pass
        (live ones included): its peak is the most of them live at once, although the pass
        sees only what is live now. (Counted by what was live at each pass, a burst of 256
        whose first rollouts had ended by a pass sized the pool at 240, and 13 of the next
        burst's 256 started cold: bench/burst.py --bursts 2.) A pool none of them uses
        counts 0 live, so its peak falls once the window has passed (and its entry stays,
        at 0: its pool is trimmed to its configured size)."""
        known = await self.demand()
        now = time.time()
        counts = Counter(pool_name(env, codebase) for env, codebase in live)
        # ``out_changes``: :meth:`out_changes` before ``live`` was read (None: as now).
        if out_changes is None:
            out_changes = await self.out_changes()
        peaks = peak_concurrency(
            [
                (pool_name(r.environment, r.codebase), r.created_at, r.closed_at)
                for r in recent or []
            ]
        )
        workspaces = {
            pool_name(r.environment, r.codebase): r.workspace
            for r in recent or []
            if r.workspace is not None
        }
        seen: dict[str, PoolDemand] = {}
        for env, codebase in [*live, *((r.environment, r.codebase) for r in recent or [])]:
            name = pool_name(env, codebase)
            peak = max(counts[name], peaks.get(name, 0))
            workspace = workspaces.get(name) or _known_workspace(known.get(name))
            seen[name] = PoolDemand(
                environment=env, codebase=codebase, peak=peak, at=now, workspace=workspace
            )
        for name, previous in known.items():
            seen.setdefault(name, previous.model_copy(update={"peak": 0, "at": now}))
        window = self.settings.pool_demand_window_s
        updates = {
            name: kept.model_dump_json()
            for name, now_seen in seen.items()
            if (kept := next_demand(known.get(name), now_seen, window)) != known.get(name)
        }
        if updates:
            await self.client.hset(self.keys.pool_demand, mapping=updates)
        # What each pool's rollouts hold now, counted afresh, unless a claim or a return
        # came since the live rollouts were read: set then, the recount would undo it (a
        # claim undone lets a refill make a sandbox the claimed one, recycled, finds no room
        # beside; it is destroyed as pool_full).
        names = sorted(seen)
        await self._recount(
            keys=[self.keys.pools_out_changes, *(self.keys.pool(n, "out") for n in names)],
            args=[out_changes, self._out_ttl_s, *(counts.get(n, 0) for n in names)],
        )

    async def ready(self, pool: str) -> list[SandboxHandle]:
        """The ready sandboxes of ``pool`` (the reaper's slot recount counts them)."""
        raws = await self.client.lrange(self.keys.pool(pool, "ready"), 0, -1)
        return [SandboxHandle.model_validate_json(raw) for raw in raws]

    async def stocked(self) -> list[str]:
        """The names of the pools whose ready list exists (configured or not any more),
        from their index: two round trips, however many rollout records Redis retains
        (a scan of the keyspace took one per 500 keys). Names whose list is gone leave it."""
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.exists(self.keys.pools_indexed)
            pipe.smembers(self.keys.pools_stocked)
            indexed, members = await pipe.execute()
        if not indexed:
            members |= await self._index_older_pools()
        names = sorted(str(name) for name in members)
        async with self.client.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.exists(self.keys.pool(name, "ready"))
            found = await pipe.execute()
        stocked = []
        for name, exists in zip(names, found, strict=True):
            if exists:
                stocked.append(name)
            else:
                await self._unstock(
                    keys=[self.keys.pools_stocked, self.keys.pool(name, "ready")], args=[name]
                )
        return stocked

    async def _index_older_pools(self) -> set[str]:
        """Once per deployment: index the ready lists a release before the index made (a
        rolling upgrade), with the scan the index replaces; the names it found."""
        head, tail = self.keys.pool("", "ready").split("::")
        names = [
            str(key).removeprefix(head + ":").removesuffix(":" + tail)
            async for key in self.client.scan_iter(match=self.keys.pool("*", "ready"), count=1000)
        ]
        async with self.client.pipeline(transaction=False) as pipe:
            if names:
                pipe.sadd(self.keys.pools_stocked, *names)
            pipe.set(self.keys.pools_indexed, "1")
            await pipe.execute()
        return set(names)

    async def levels(self, pool: str) -> tuple[int, int]:
        """(ready, being created) of ``pool``, in one round trip."""
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.llen(self.keys.pool(pool, "ready"))
            pipe.get(self.keys.pool(pool, "pending"))
            ready, pending = await pipe.execute()
        return int(ready), max(0, int(pending or 0))

    async def refill_due(self) -> bool:
        """Whether to ask the workers to top the pools up after a claim: once a second at
        most, as the task tops up every pool and a burst of claims needs one of it."""
        return bool(await self.client.set(self.keys.pool_refill_requested, "1", nx=True, px=1000))

    @staticmethod
    def _in_transit(handle: SandboxHandle) -> str:
        return transit_member(handle.host, handle.sandbox_id)
