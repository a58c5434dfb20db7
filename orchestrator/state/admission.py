"""Admission control: a new sandbox goes to a host only within that host's capacity.

Every sandbox holds a slot of its host (``host-rollouts``: sandboxes per host, pool
sandboxes included) from before it is created until it is destroyed. A slot is taken by
one Lua step that picks the least loaded schedulable host still under its capacity, so a
burst of hundreds of rollouts in one second cannot overcommit a host between two
heartbeats. Past capacity, a new rollout waits in a bounded queue (at most
``admission_queue_max`` waiting, each at most ``admission_wait_s``), seated first come
first served within its tenant (in the order of their deadlines, which for one kind of
request is the order they came in: neither a new arrival nor a pool's refill takes a slot
one of them wants) and across tenants by their fair share (a tenant holding fewer
sandboxes is seated first: one tenant's burst cannot hold every slot),
then is refused with
:class:`AtCapacity`: 503 + Retry-After for Agent RFT (the trainer retries, then
discards), 429 + Retry-After for the rollout API.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import redis
import redis.asyncio as aioredis

from orchestrator.config import Settings
from orchestrator.observability import metrics
from orchestrator.state.heartbeat import Heartbeats
from orchestrator.state.keys import Keys
from orchestrator.tenants import DEFAULT_TENANT

# Takes a slot on the least loaded host under its capacity and counts it in transit for its
# holder, in one step: until the record of the new rollout, or the pool's ready list, counts
# it, the reaper's recount (which reads those) must not give the slot away. (Taken first
# and marked after, a recount in between once admitted one rollout too many to a full
# host.) A taker gets a slot only while more are free than rollouts wait ahead of it in the
# admission queue (all of them, for a taker not in it: a new arrival, or a pool's refill,
# never takes a slot from a rollout that waits).
#
# Who is ahead of a waiter is its tenant's fair share (docs/tenancy.md): the waiters are
# seated in the order of their tenant's virtual time, the sandboxes the tenant holds plus
# its waiters before this one, so a tenant holding few is seated before one holding many;
# a tie goes to the one that came first. Within one tenant that is first come first served,
# a GRPO group's together (their scores are equal); with one tenant it is the queue's order.
# Each tenant's count is read by name: its held set (state/quotas.py, which its waiters
# have entered already) and its waiting set, both under the prefix given.
#
# KEYS: load hash, slots in transit, admission queue, the waiting tenants. ARGV: transit
# member's tag, until when to count it, the taker's place in the queue ('' when not in it),
# now, the taker's tenant ('' none), the tenants' key prefix, then host, capacity, host,
# capacity, ... in the order to prefer on a tie. Returns the host whose slot was taken, or
# false.
TAKE_SLOT = """
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[4])
local function waiting_of(u) return ARGV[6] .. u .. ':waiting' end
local function fair_ahead(rank)
  local tenant = ARGV[5]
  local mine = redis.call('ZRANK', waiting_of(tenant), ARGV[3])
  if not mine then return rank end
  local counts = {}
  for _, u in ipairs(redis.call('SMEMBERS', KEYS[4])) do
    redis.call('ZREMRANGEBYSCORE', waiting_of(u), '-inf', ARGV[4])
    local n = redis.call('ZCARD', waiting_of(u))
    if n == 0 then
      redis.call('SREM', KEYS[4], u)
    else
      local held = redis.call('ZCARD', ARGV[6] .. u .. ':sandboxes') - n
      counts[u] = {n, math.max(0, held)}
    end
  end
  if not counts[tenant] then return rank end
  local time = counts[tenant][2] + mine
  local ahead = mine
  for u, count in pairs(counts) do
    if u ~= tenant then
      local before = math.min(count[1], math.max(0, time - count[2]))
      ahead = ahead + before
      if before < count[1] and count[2] + before == time then
        local tie = redis.call('ZRANGE', waiting_of(u), before, before)[1]
        local tie_rank = redis.call('ZRANK', KEYS[3], tie)
        if tie_rank and tie_rank < rank then ahead = ahead + 1 end
      end
    end
  end
  return ahead
end
local ahead = false
if ARGV[3] ~= '' then
  local rank = redis.call('ZRANK', KEYS[3], ARGV[3])
  if rank and ARGV[5] ~= '' then ahead = fair_ahead(rank) else ahead = rank end
end
if not ahead then ahead = redis.call('ZCARD', KEYS[3]) end
local best, best_load, free = nil, nil, 0
for i = 7, #ARGV, 2 do
  local load = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  local capacity = tonumber(ARGV[i + 1])
  if load < capacity then
    free = free + capacity - load
    if best_load == nil or load < best_load then best, best_load = ARGV[i], load end
  end
end
if best == nil or free <= ahead then return false end
redis.call('HINCRBY', KEYS[1], best, 1)
redis.call('ZADD', KEYS[2], ARGV[2], best .. '|' .. ARGV[1])
return best
"""

# KEYS: waiting set, waiting groups, the waiter's tenant's waiting set, the waiting
# tenants. ARGV: now, deadline, waiter id, queue bound, group ('' for none), group window,
# tenant. Returns 1 when the waiter is in the queue; the set's scores are deadlines, so a
# crashed waiter ages out. A waiter of a group whose first waiter came within the window
# takes that one's score: its place, next to its group (a GRPO group is seated together).
# Its entry so ages out earlier than its own deadline by at most the window, which the
# deadline's grace covers (Admission.take). It enters its tenant's waiting set too, with
# the same score (TAKE_SLOT's fair share).
_ENTER = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then return 0 end
local score = ARGV[2]
if ARGV[5] ~= '' then
  local first = redis.call('ZSCORE', KEYS[2], ARGV[5])
  if first and tonumber(first) >= tonumber(ARGV[2]) - tonumber(ARGV[6]) then
    score = first
  else
    redis.call('ZADD', KEYS[2], ARGV[2], ARGV[5])
  end
end
redis.call('ZADD', KEYS[1], score, ARGV[3])
redis.call('ZADD', KEYS[3], score, ARGV[3])
redis.call('SADD', KEYS[4], ARGV[7])
return 1
"""

QUEUE_GRACE_S = 5.0
"""A waiter's entry outlives its wait by this much, and a group's later waiters take its
first one's place within this much of it (so their entries never age out early)."""


TRANSIT_MAX_S = 900
"""A slot in transit for longer than this belongs to a holder that crashed: the recount
stops counting it (a pool creation waits at most the create lane plus a start; a hand-out
at most a probe)."""


def transit_member(host: str, tag: str) -> str:
    return f"{host}|{tag}"


def count_in_transit(members: list[str]) -> dict[str, int]:
    """Slots in transit per host, from the set's members."""
    counts: dict[str, int] = {}
    for member in members:
        host = member.rpartition("|")[0]
        counts[host] = counts.get(host, 0) + 1
    return counts


class AtCapacity(Exception):
    """No host could take a new sandbox within the bound: try again later."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class Admission:
    """The API's side of slots: take one for a new sandbox, give it back."""

    def __init__(self, settings: Settings, client: aioredis.Redis) -> None:
        self.settings = settings
        self.redis = client
        self.keys = Keys.of(settings.deployment)
        self.heartbeats = Heartbeats(client, self.keys)
        self._take = self.redis.register_script(TAKE_SLOT)
        self._enter = self.redis.register_script(_ENTER)

    async def try_take(
        self,
        holder: str,
        waiter: str = "",
        only_host: str | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> str | None:
        """A slot on a schedulable host now (``only_host``, when given: a sandbox made from
        a snapshot that host keeps), or None; counted in transit for ``holder`` until
        :meth:`settled` (its record names the host) or :meth:`release`. None too while the
        rollouts waiting ahead (``waiter``: the caller's place in the queue; none: every
        one in it) want every free slot."""
        pairs: list[Any] = []
        hosts = [
            beat
            for beat in await self.heartbeats.live()
            if beat.schedulable and only_host in (None, beat.host)
        ]
        random.shuffle(hosts)  # a tie goes to any of them: a burst spreads out
        for beat in hosts:
            capacity = beat.capacity or self.settings.host_max_sandboxes
            pairs += [beat.host, capacity]
        if not pairs:
            return None
        now = time.time()
        host = await self._take(
            keys=[self.keys.load, self.keys.transit, self.keys.waiting, self.keys.waiting_tenants],
            args=[
                _holder_tag(holder),
                now + TRANSIT_MAX_S,
                waiter,
                now,
                tenant,
                self.keys.tenant_prefix,
                *pairs,
            ],
        )
        return str(host) if host else None

    async def take(
        self,
        holder: str,
        *,
        give_up: Callable[[], Awaitable[bool]] | None = None,
        wait_s: float | None = None,
        group: str | None = None,
        only_host: str | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> str:
        """A slot for ``holder`` (see :meth:`try_take`), waiting in the bounded queue if
        every host is full, for at most ``wait_s`` (default and upper bound:
        ``admission_wait_s``), seated first come first served within its ``tenant``, the
        waiters of one ``group`` (a GRPO group: rollouts of one dataset item) together, and
        across tenants by their fair share (a tenant holding fewer sandboxes first).
        ``give_up`` is asked while waiting (another request created the rollout
        meanwhile): then :class:`AtCapacity` is not raised, ``""`` is returned.
        ``only_host``: a slot of that host only (:meth:`try_take`)."""
        host = await self.try_take(holder, only_host=only_host, tenant=tenant)
        if host is not None:
            return host
        limit = self.settings.admission_wait_s
        wait_s = limit if wait_s is None else min(wait_s, limit)
        waiting = self.keys.waiting
        waiter = uuid.uuid4().hex
        now = time.time()
        mine = self.keys.tenant_waiting(tenant)
        entered = await self._enter(
            keys=[waiting, self.keys.waiting_groups, mine, self.keys.waiting_tenants],
            args=[
                now,
                now + wait_s + QUEUE_GRACE_S,
                waiter,
                self.settings.admission_queue_max,
                group or "",
                QUEUE_GRACE_S,
                tenant,
            ],
        )
        if not entered:
            metrics.ADMISSION_REJECTED.labels("queue_full").inc()
            raise AtCapacity(
                "every host is at capacity and the admission queue is full",
                retry_after_s=self._retry_after(),
            )
        try:
            deadline = time.monotonic() + wait_s
            delay = 0.05
            while time.monotonic() < deadline:
                # At most a quarter second: a slot kept for the head of the queue stays
                # unused until the head asks again.
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))  # noqa: S311 - jitter
                delay = min(delay * 1.5, 0.25)
                host = await self.try_take(holder, waiter, only_host, tenant)
                if host is not None:
                    return host
                if give_up is not None and await give_up():
                    return ""
        finally:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zrem(waiting, waiter)
                pipe.zrem(mine, waiter)
                await pipe.execute()
        metrics.ADMISSION_REJECTED.labels("at_capacity").inc()
        raise AtCapacity(
            f"every host stayed at capacity for {wait_s:.0f} s", retry_after_s=self._retry_after()
        )

    async def release(self, host: str, holder: str | None = None) -> None:
        """Give a slot back (the sandbox was destroyed, or never made); ``holder``: the one
        :meth:`take` counted in transit, which the slot leaves too."""
        if holder is None:
            await self.redis.hincrby(self.keys.load, host, -1)
            return
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(self.keys.load, host, -1)
            pipe.zrem(self.keys.transit, transit_member(host, _holder_tag(holder)))
            await pipe.execute()

    async def hold_for_recycling(self, host: str, sandbox_id: str) -> str:
        """Keep the slot of a sandbox leaving its rollout for its pool (recycling): counted
        in transit from now until the worker puts it in the pool or destroys it (which
        gives the slot back, :func:`release_slot`). Returns the transit member, or '' when
        the sandbox is on its way already (two closes of one rollout at once: only one
        may send it, or it would lie in its pool twice, for two rollouts)."""
        member = transit_member(host, f"recycle:{sandbox_id}")
        added = await self.redis.zadd(
            self.keys.transit, {member: time.time() + TRANSIT_MAX_S}, nx=True
        )
        return member if added else ""

    async def settled(self, host: str, holder: str) -> None:
        """``holder``'s slot is counted by its record now: no longer in transit."""
        await self.redis.zrem(self.keys.transit, transit_member(host, _holder_tag(holder)))

    async def in_transit(self) -> dict[str, int]:
        """Slots held per host by sandboxes in transit (see :func:`transit_key`)."""
        key = self.keys.transit
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zremrangebyscore(key, "-inf", time.time())
            pipe.zrange(key, 0, -1)
            _, members = await pipe.execute()
        return count_in_transit([str(m) for m in members])

    async def recount(self, count: Callable[[dict[str, int]], Awaitable[dict[str, int]]]) -> bool:
        """Replace the slot counts with ``count(in_transit)``'s, counted from what holds
        slots (the reaper: records and ready lists), so a count that drifted (a crash
        between taking a slot and using it) heals. Not if a slot was taken, released or
        moved while it counted: then nothing changes and False is returned (the next pass
        counts again).

        Why: the count reads many keys one after another. A rollout that took its slot
        after its record was read and settled before the transit set was read was in
        neither, and one taken after the count but before it was written was overwritten:
        either way one slot given away (a host admitted past its capacity; seen as a
        fifth sandbox on a host of four). Every move of a slot changes the load hash or the
        transit set, so both are watched, and the count is written only if neither moved.
        """
        key = self.keys.transit
        # Dropped before the watch: our own write to a watched key would abort us.
        await self.redis.zremrangebyscore(key, "-inf", time.time())
        async with self.redis.pipeline(transaction=True) as pipe:
            await pipe.watch(self.keys.load, key)
            members = await pipe.zrange(key, 0, -1)
            counts = await count(count_in_transit([str(m) for m in members]))
            pipe.multi()  # type: ignore[no-untyped-call]
            pipe.delete(self.keys.load)
            if counts:
                pipe.hset(self.keys.load, mapping=counts)  # type: ignore[arg-type]
            try:
                await pipe.execute()
            except redis.WatchError:
                return False
        return True

    async def loads(self) -> dict[str, int]:
        """Slots held per host."""
        return {str(k): int(v) for k, v in (await self.redis.hgetall(self.keys.load)).items()}

    async def waiting(self, now: float) -> int:
        """New rollouts waiting for a slot now."""
        return int(await self.redis.zcount(self.keys.waiting, now, "+inf"))

    def _retry_after(self) -> int:
        return max(1, int(self.settings.admission_retry_after_s))


def _holder_tag(holder: str) -> str:
    return f"start:{holder}"


def release_slot(client: redis.Redis, keys: Keys, host: str, transit: str = "") -> None:
    """The worker's side (sync): give back a slot of ``host`` (its sandbox is gone or was
    never made), and stop counting it in transit (``transit``: its member, if any)."""
    if not transit:
        client.hincrby(keys.load, host, -1)
        return
    pipe = client.pipeline(transaction=True)
    pipe.hincrby(keys.load, host, -1)
    pipe.zrem(keys.transit, transit)
    pipe.execute()
