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

    async def close(self) -> None:
        await self.redis.aclose()

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    # -- the record ------------------------------------------------------------------------

    async def get(self, rollout_id: str) -> Rollout | None:
        raw = cast(dict[str, str], await self.redis.hgetall(self.key("rollout", rollout_id)))
        return _decode(raw) if raw else None

    async def create(self, rollout: Rollout) -> bool:
        """Store a new record; False when the id exists already (someone else won)."""
        created = await self.redis.hsetnx(
            self.key("rollout", rollout.rollout_id), "rollout_id", rollout.rollout_id
        )
        if not created:
            return False
        await self.save(rollout)
        return True

    async def save(self, rollout: Rollout) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            # redis-py's hset wants its own key union; ours are all str.
            pipe.hset(self.key("rollout", rollout.rollout_id), mapping=cast(Any, _encode(rollout)))
            if rollout.state == RolloutState.CLOSED or rollout.closed_at is not None:
                pipe.zrem(self.key("rollouts", "live"), rollout.rollout_id)
            else:
                pipe.zadd(self.key("rollouts", "live"), {rollout.rollout_id: rollout.last_activity})
            await pipe.execute()

    async def update(self, rollout_id: str, **fields: Any) -> Rollout | None:
        """Read-modify-write of a few fields. ``infra_failed`` is sticky: once set, later
        updates cannot move the rollout back to another state."""
        current = await self.get(rollout_id)
        if current is None:
            return None
        sticky = current.state == RolloutState.INFRA_FAILED
        if sticky and fields.get("state", RolloutState.INFRA_FAILED) != RolloutState.INFRA_FAILED:
            fields.pop("state")
        updated = current.model_copy(update=fields)
        await self.save(updated)
        return updated

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
