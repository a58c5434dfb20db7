"""A tenant's quotas, kept in Redis so every API process counts the same (docs/tenancy.md).

- **Sandboxes held at once**: a sorted set per tenant of the rollouts holding (or making)
  a sandbox. A new rollout enters it before it takes a warm sandbox or a host's slot, and
  leaves it when it is closed or paused; one step checks the count and enters, so a burst
  from many API processes cannot pass the quota between two reads. A member whose rollout
  ended without leaving (its API process died in between) is found and removed when the
  tenant is at its quota, before anyone is refused.
- **Warm sandboxes held at once**: a sorted set per tenant of the rollouts holding a
  sandbox from a pool, entered in one step with its check before the rollout looks in a
  pool; a tenant at its quota is not refused: its rollout gets a cold sandbox.
- **Creations and calls per second**: a token bucket per tenant and kind, refilled at the
  rate, holding at most one second's worth (a burst of up to the rate, then the rate).

Over a quota is :class:`OverQuota`, an :class:`~orchestrator.state.admission.AtCapacity`:
429 with Retry-After, 503 on Agent RFT (which retries, then discards), as for capacity.
"""

from __future__ import annotations

import math
import time
from typing import Any, cast

import redis.asyncio as aioredis

from orchestrator.observability import metrics
from orchestrator.state.admission import AtCapacity
from orchestrator.state.keys import Keys
from orchestrator.state.models import RolloutState
from orchestrator.state.records import Rollout, RolloutStore
from orchestrator.tenants import Principal

_BUCKET = """
local function take(key, rate, now)
  local state = redis.call('HMGET', key, 'tokens', 'at')
  local tokens = tonumber(state[1] or rate)
  local at = tonumber(state[2] or now)
  tokens = math.min(rate, tokens + (now - at) * rate)
  if tokens < 1 then return 'wait:' .. tostring((1 - tokens) / rate) end
  redis.call('HSET', key, 'tokens', tokens - 1, 'at', now)
  redis.call('EXPIRE', key, 60)
  return 0
end
"""
"""A token bucket's take, in Lua: 0 when a token was taken, else ``wait:<seconds>`` until
one is there (a string: Lua's numbers are cut to integers on their way out, and a bare
"1" would read as another answer)."""

# KEYS: the tenant's held set (or its warm set), its creations bucket, the tenants seen.
# ARGV: now, rollout id, the set's quota (-1: none), creations per second (-1: none), a
# member older than this (Unix time) is forgotten, the tenant. Returns 0 when entered (or
# already in), 1 when at the set's quota, else the bucket's ``wait:<seconds>``.
_ENTER = (
    _BUCKET
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[5])
redis.call('SADD', KEYS[3], ARGV[6])
if redis.call('ZSCORE', KEYS[1], ARGV[2]) then return 0 end
local limit = tonumber(ARGV[3])
if limit >= 0 and redis.call('ZCARD', KEYS[1]) >= limit then return 1 end
local rate = tonumber(ARGV[4])
if rate > 0 then
  local wait = take(KEYS[2], rate, tonumber(ARGV[1]))
  if wait ~= 0 then return wait end
end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
return 0
"""
)

# KEYS: the tenant's bucket. ARGV: now, rate. Returns the bucket's take.
_TAKE = _BUCKET + "return take(KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[1]))\n"

MEMBER_MAX_S = 7 * 24 * 3600
"""A member this old is forgotten whatever its rollout's state: a bound on what a crash
leaves behind (a live rollout's own state keeps it counted until then)."""
STARTING_MAX_S = 15 * 60
"""A member with no record for this long is a start that died before making one."""

HOLDING = (RolloutState.CREATING, RolloutState.ACTIVE, RolloutState.GRADED)
"""Rollout states that hold a sandbox (a graded one holds it until it is closed)."""


class OverQuota(AtCapacity):
    """A tenant is at one of its quotas: try again after ``retry_after_s``."""

    def __init__(self, tenant: str, quota: str, message: str, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.tenant = tenant
        self.quota = quota


class TenantQuotas:
    """The API's side of tenants' quotas: enter a new sandbox, leave it, take a call."""

    def __init__(self, store: RolloutStore) -> None:
        self.store = store
        self.redis: aioredis.Redis = store.redis
        self.keys: Keys = store.keys
        self._enter = self.redis.register_script(_ENTER)
        self._take = self.redis.register_script(_TAKE)

    async def enter(self, caller: Principal, rollout_id: str) -> None:
        """Count ``rollout_id``'s sandbox against ``caller``'s tenant (again: nothing),
        or :class:`OverQuota`."""
        quotas = caller.quotas
        held = self.keys.tenant_sandboxes(caller.tenant)
        rate = quotas.creations_per_s
        found = await self._try_enter(held, caller.tenant, rollout_id, quotas.sandboxes, rate)
        if found == "1" and await self._forget_ended(held):
            found = await self._try_enter(held, caller.tenant, rollout_id, quotas.sandboxes, rate)
        if found == "0":
            return
        if found == "1":
            self._refused(caller.tenant, "sandboxes")
            raise OverQuota(
                caller.tenant,
                "sandboxes",
                f"tenant {caller.tenant!r} holds its quota of {quotas.sandboxes} sandboxes: "
                "end a rollout, or try again later",
                retry_after_s=1,
            )
        self._refused(caller.tenant, "creations_per_s")
        raise OverQuota(
            caller.tenant,
            "creations_per_s",
            f"tenant {caller.tenant!r} makes sandboxes faster than its quota of "
            f"{quotas.creations_per_s}/s",
            retry_after_s=_retry_after(found),
        )

    async def leave(self, tenant: str, rollout_id: str) -> None:
        """``rollout_id`` holds no sandbox of ``tenant``'s any more (closed, paused)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(self.keys.tenant_sandboxes(tenant), rollout_id)
            pipe.zrem(self.keys.tenant_warm(tenant), rollout_id)
            await pipe.execute()

    async def enter_warm(self, caller: Principal, rollout_id: str) -> bool:
        """Whether ``rollout_id`` may take a warm sandbox: ``caller``'s tenant has no
        ``warm_sandboxes`` quota (no round trip), or is within it (entered). False: its
        rollout makes a cold one (counted as refused, quota ``warm_sandboxes``)."""
        limit = caller.quotas.warm_sandboxes
        if limit is None:
            return True
        # The held set's script on the warm set, with no rate: one check-and-enter.
        warm = self.keys.tenant_warm(caller.tenant)
        if await self._try_enter(warm, caller.tenant, rollout_id, limit, None) == "0":
            return True
        if (
            await self._forget_ended(warm)
            and await self._try_enter(warm, caller.tenant, rollout_id, limit, None) == "0"
        ):
            return True
        self._refused(caller.tenant, "warm_sandboxes")
        return False

    async def leave_warm(self, tenant: str, rollout_id: str) -> None:
        """``rollout_id`` found no warm sandbox after all (its pool was empty)."""
        await self.redis.zrem(self.keys.tenant_warm(tenant), rollout_id)

    async def call(self, caller: Principal) -> None:
        """Take a tool call from ``caller``'s tenant's bucket, or :class:`OverQuota`. Free
        (no round trip) for a tenant with no calls quota."""
        rate = caller.quotas.calls_per_s
        if rate is None:
            return
        key = self.keys.tenant_bucket(caller.tenant, "calls")
        taken = await self._take(keys=[key], args=[time.time(), rate])
        found = _text(taken) if isinstance(taken, (bytes, str)) else str(taken)
        if found == "0":
            return
        self._refused(caller.tenant, "calls_per_s")
        raise OverQuota(
            caller.tenant,
            "calls_per_s",
            f"tenant {caller.tenant!r} calls tools faster than its quota of {rate}/s",
            retry_after_s=_retry_after(found),
        )

    async def held(self, tenant: str) -> int:
        """Sandboxes ``tenant``'s rollouts hold (or are making) now."""
        return int(await self.redis.zcard(self.keys.tenant_sandboxes(tenant)))

    async def _try_enter(
        self, key: str, tenant: str, rollout_id: str, limit: int | None, rate: float | None
    ) -> str:
        """Enter ``rollout_id`` into the tenant's set ``key`` within ``limit`` members, and
        take a creation at ``rate`` (None: no bound): the script's answer (_ENTER)."""
        now = time.time()
        found = await self._enter(
            keys=[key, self.keys.tenant_bucket(tenant, "creations"), self.keys.tenants_seen],
            args=[
                now,
                rollout_id,
                -1 if limit is None else limit,
                -1 if rate is None else rate,
                now - MEMBER_MAX_S,
                tenant,
            ],
        )
        return _text(found) if isinstance(found, (bytes, str)) else str(found)

    async def _forget_ended(self, key: str) -> bool:
        """Remove the members of a tenant's set ``key`` whose rollout holds no sandbox any
        more (ended, failed and closed, paused: its API process died before it left);
        whether any was."""
        raw = await self.redis.zrange(key, 0, -1, withscores=True)
        scored = [(_text(member), float(at)) for member, at in cast(list[tuple[Any, Any]], raw)]
        records = await self.store.get_many([member for member, _ in scored])
        now = time.time()
        ended = [
            member
            for (member, at), record in zip(scored, records, strict=True)
            if (now - at > STARTING_MAX_S if record is None else not _holds(record))
        ]
        if ended:
            await self.redis.zrem(key, *ended)
        return bool(ended)

    @staticmethod
    def _refused(tenant: str, quota: str) -> None:
        metrics.QUOTA_REFUSED.labels(tenant, quota).inc()


def _retry_after(wait: str) -> int:
    """Whole seconds to wait, at least one, from a bucket's ``wait:<seconds>``."""
    return max(1, math.ceil(float(wait.removeprefix("wait:"))))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _holds(record: Rollout) -> bool:
    """Whether a rollout holds its sandbox still (a member with no record is a start whose
    record comes after its slot)."""
    return record.closed_at is None and record.state in HOLDING
