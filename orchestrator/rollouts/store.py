"""Rollout state in Redis: the record, the trajectory, idempotent call results, locks.

Keys (all under the deployment's prefix):
  rollout:{id}            hash: the record (see Rollout)
  rollout:{id}:traj       list: TrajectoryStep JSON, in call order
  rollout:{id}:seq        counter of calls made (budget and trajectory order)
  rollout:{id}:call:{cid} the reply of call ``cid``, stored once, returned to retries
  rollout:{id}:lock:{x}   short-lived NX locks (sandbox creation, one call id in flight)
  rollouts:live           sorted set: id -> last activity (the reaper walks it)
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, cast

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from orchestrator.outcomes import Outcome
from orchestrator.rollouts.models import RolloutState, TrajectoryStep
from orchestrator.sandbox.backend import SandboxHandle


class Rollout(BaseModel):
    """The record of one rollout."""

    rollout_id: str
    source: str = Field(description="agent_rft or api")
    environment: str
    codebase: str | None = None
    image: str
    state: RolloutState
    host: str | None = None
    sandbox: SandboxHandle | None = None
    item: dict[str, Any] = Field(default_factory=dict)
    created_at: float
    last_activity: float
    sandbox_ready_at: float | None = None
    graded_at: float | None = None
    closed_at: float | None = None
    score: float | None = None
    grade_details: dict[str, Any] | None = None
    outcome: Outcome | None = None
    infra_failure: dict[str, Any] | None = Field(
        None, description="Why the rollout was marked infra_failed, with the evidence."
    )
    calls_in_flight: int = Field(0, description="Running calls: a busy rollout is not idle.")


_JSON_FIELDS = {"sandbox", "item", "grade_details", "infra_failure"}


def _encode(rollout: Rollout) -> dict[str, str]:
    data = rollout.model_dump(mode="json")
    return {
        k: json.dumps(v) if k in _JSON_FIELDS else ("" if v is None else str(v))
        for k, v in data.items()
    }


def _decode(raw: dict[str, str]) -> Rollout:
    data: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _JSON_FIELDS:
            data[key] = json.loads(value)
        else:
            data[key] = value if value != "" else None
    return Rollout.model_validate(data)


# KEYS: record, live set. ARGV: id, last activity, field/value pairs.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return 1
"""

# KEYS: record, live set. ARGV: id, mode ('once' or ''), field/value pairs.
_UPDATE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
if ARGV[2] == 'once' then
  local score = redis.call('HGET', KEYS[1], 'score')
  if score and score ~= '' then return redis.call('HGETALL', KEYS[1]) end
end
local state = redis.call('HGET', KEYS[1], 'state')
for i = 3, #ARGV, 2 do
  if not (ARGV[i] == 'state' and state == 'infra_failed' and ARGV[i + 1] ~= 'infra_failed') then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
local closed = redis.call('HGET', KEYS[1], 'closed_at')
if (closed and closed ~= '') or redis.call('HGET', KEYS[1], 'state') == 'closed' then
  redis.call('ZREM', KEYS[2], ARGV[1])
else
  redis.call('ZADD', KEYS[2], redis.call('HGET', KEYS[1], 'last_activity'), ARGV[1])
end
return redis.call('HGETALL', KEYS[1])
"""


class LockTimeout(Exception):
    """A lock held by another call was not released in time."""


class RolloutStore:
    """Async access to rollout state. One instance per process."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        # Strings in and out: every value we keep is text (JSON or a number).
        self.redis: aioredis.Redis = aioredis.Redis.from_url(
            redis_url, max_connections=512, decode_responses=True
        )
        self.prefix = prefix
        self._create_script = self.redis.register_script(_CREATE)
        self._update_script = self.redis.register_script(_UPDATE)

    async def close(self) -> None:
        await self.redis.aclose()

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    # -- the record ------------------------------------------------------------------------

    async def get(self, rollout_id: str) -> Rollout | None:
        raw = cast(dict[str, str], await self.redis.hgetall(self.key("rollout", rollout_id)))
        return _decode(raw) if raw else None

    async def create(self, rollout: Rollout) -> bool:
        """Store a new record in one step (a concurrent reader never sees half of it);
        False when the id exists already (someone else won)."""
        pairs = [x for kv in _encode(rollout).items() for x in kv]
        created = await self._create_script(
            keys=[self.key("rollout", rollout.rollout_id), self.key("rollouts", "live")],
            args=[rollout.rollout_id, rollout.last_activity, *pairs],
        )
        return bool(created)

    async def update(self, rollout_id: str, *, once: bool = False, **fields: Any) -> Rollout | None:
        """Set a few fields atomically and return the record as it then is.

        ``infra_failed`` is sticky: once set, no update moves the rollout to another state.
        ``once``: set the fields only if the rollout has no score yet (grading), so
        concurrent grade retries all end up with the one score stored first.
        """
        current = await self.get(rollout_id)
        if current is None:
            return None
        encoded = _encode(current.model_copy(update=fields))
        pairs = [x for name in fields for x in (name, encoded[name])]
        raw = await self._update_script(
            keys=[self.key("rollout", rollout_id), self.key("rollouts", "live")],
            args=[rollout_id, "once" if once else "", *pairs],
        )
        if not raw:
            return None
        flat = [str(x) for x in raw]
        return _decode(dict(zip(flat[::2], flat[1::2], strict=True)))

    async def calls_in_flight(self, rollout_id: str, delta: int) -> None:
        await self.redis.hincrby(self.key("rollout", rollout_id), "calls_in_flight", delta)

    async def touch(self, rollout_id: str) -> None:
        now = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.key("rollout", rollout_id), "last_activity", str(now))
            pipe.zadd(self.key("rollouts", "live"), {rollout_id: now}, xx=True)
            await pipe.execute()

    async def live_ids(self) -> list[str]:
        ids = await self.redis.zrange(self.key("rollouts", "live"), 0, -1)
        return [str(i) for i in ids]

    async def recent_ids(self, limit: int = 100) -> list[str]:
        ids = await self.redis.zrevrange(self.key("rollouts", "live"), 0, limit - 1)
        return [str(i) for i in ids]

    # -- calls and the trajectory ----------------------------------------------------------

    async def next_seq(self, rollout_id: str) -> int:
        return int(await self.redis.incr(self.key("rollout", rollout_id, "seq")))

    async def call_count(self, rollout_id: str) -> int:
        value = await self.redis.get(self.key("rollout", rollout_id, "seq"))
        return int(value or 0)

    async def append_step(self, rollout_id: str, step: TrajectoryStep) -> None:
        await self.redis.rpush(self.key("rollout", rollout_id, "traj"), step.model_dump_json())

    async def trajectory(self, rollout_id: str) -> list[TrajectoryStep]:
        raw = await self.redis.lrange(self.key("rollout", rollout_id, "traj"), 0, -1)
        steps = [TrajectoryStep.model_validate_json(r) for r in raw]
        return sorted(steps, key=lambda s: s.seq)

    async def stored_reply(self, rollout_id: str, call_id: str) -> dict[str, Any] | None:
        raw = await self.redis.get(self.key("rollout", rollout_id, "call", call_id))
        return json.loads(raw) if raw else None

    async def store_reply(self, rollout_id: str, call_id: str, reply: dict[str, Any]) -> None:
        await self.redis.set(
            self.key("rollout", rollout_id, "call", call_id), json.dumps(reply), ex=7 * 86400
        )

    # -- locks -----------------------------------------------------------------------------

    @asynccontextmanager
    async def lock(
        self, rollout_id: str, name: str, *, ttl_s: float, wait_s: float
    ) -> AsyncIterator[None]:
        """A simple NX lock with a TTL, so a crashed holder cannot block forever."""
        key = self.key("rollout", rollout_id, "lock", name)
        token = f"{time.time()}"
        deadline = time.monotonic() + wait_s
        delay = 0.002
        while not await self.redis.set(key, token, nx=True, px=int(ttl_s * 1000)):
            if time.monotonic() > deadline:
                raise LockTimeout(f"lock {name!r} of rollout {rollout_id} held too long")
            await _sleep(delay)
            delay = min(delay * 2, 0.05)
        try:
            yield
        finally:
            # Release only our own lock (it may have expired and been taken by another).
            if (await self.redis.get(key)) == token:
                await self.redis.delete(key)

    async def delete_all(self, rollout_id: str) -> None:
        """Forget a rollout entirely (tests and explicit purges)."""
        keys = [k async for k in self.redis.scan_iter(self.key("rollout", rollout_id) + "*")]
        if keys:
            await self.redis.delete(*keys)
        await self.redis.zrem(self.key("rollouts", "live"), rollout_id)

    async def ping(self) -> bool:
        return bool(await self.redis.ping())


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


def now_utc() -> datetime:
    return datetime.now(UTC)
