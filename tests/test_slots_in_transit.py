"""Slots held by pool sandboxes in transit, on real Redis: a pool creation and a hand-out
are counted from the moment they take their slot until the ready list or the rollout's
record counts them, so the reaper's recount never gives their slots away."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aioredis

from orchestrator.config import Settings
from orchestrator.environments.loader import ResolvedEnvironment, load_environments
from orchestrator.sandbox.backend import SandboxHandle, SandboxSpec
from orchestrator.state.admission import Admission
from orchestrator.state.heartbeat import Heartbeat
from orchestrator.state.keys import Keys
from orchestrator.state.pool_sizing import PoolTarget
from orchestrator.state.pools import PoolClaims, PoolFiller
from tests.redis_units import POOLED_ENVIRONMENT, own_deployment, pool_handle


@pytest.fixture
def unit(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    path = tmp_path_factory.mktemp("transit") / "environments.yaml"
    path.write_text(POOLED_ENVIRONMENT)
    with own_deployment(settings, "tr", path) as own:
        yield own


def _handle(settings: Settings, sandbox_id: str) -> SandboxHandle:
    return pool_handle(settings.host_id, sandbox_id, "orchestrator/sandbox-base:latest")


def _resolved(settings: Settings) -> ResolvedEnvironment:
    return load_environments(settings).resolve({"environment": "pooled"})


def test_a_pool_creation_is_in_transit_until_delivered(unit: Settings) -> None:
    async def scenario() -> None:
        sync = redis.Redis.from_url(unit.redis_url)
        async_redis = aioredis.Redis.from_url(unit.redis_url, decode_responses=True)
        admission = Admission(unit, async_redis)
        filler = PoolFiller(unit, sync)
        pool = PoolTarget(name="pooled:-", size=2, spec=SandboxSpec(image="x"))
        try:
            assert await admission.in_transit() == {}
            creating = filler.take_slot("create:one")
            failing = filler.take_slot("create:two")
            assert creating is not None and failing is not None
            assert await admission.in_transit() == {unit.host_id: 2}
            # Delivered: the ready list counts it now, not the transit set.
            filler.deliver(pool, _handle(unit, "sbx-one"), creating)
            filler.deliver(pool, None, failing)
            assert await admission.in_transit() == {}
            assert sync.llen(Keys.of(unit.deployment).pool("pooled:-", "ready")) == 1
        finally:
            sync.close()
            await async_redis.aclose()

    asyncio.run(scenario())


def test_a_hand_out_is_in_transit_until_bound_or_forgotten(unit: Settings) -> None:
    async def scenario() -> None:
        async_redis = aioredis.Redis.from_url(unit.redis_url, decode_responses=True)
        admission = Admission(unit, async_redis)
        claims = PoolClaims(unit, async_redis)
        resolved = _resolved(unit)
        ready = Keys.of(unit.deployment).pool("pooled:-", "ready")
        try:
            for sandbox_id in ("sbx-a", "sbx-b"):
                await async_redis.rpush(ready, _handle(unit, sandbox_id).model_dump_json())
            first = await claims.take(resolved)
            second = await claims.take(resolved)
            assert first is not None and second is not None
            assert await claims.take(resolved) is None
            # Taken from the ready list, not yet a rollout's: still holding their slots.
            assert await admission.in_transit() == {unit.host_id: 2}
            await claims.bind(first, "ro_one", ttl_s=60)
            await claims.forget(second)
            assert await admission.in_transit() == {}
        finally:
            await async_redis.aclose()

    asyncio.run(scenario())


def test_a_crashed_holders_slot_stops_counting(unit: Settings) -> None:
    async def scenario() -> None:
        async_redis = aioredis.Redis.from_url(unit.redis_url, decode_responses=True)
        admission = Admission(unit, async_redis)
        try:
            # A holder that died long ago: its member's deadline has passed.
            await async_redis.zadd(
                Keys.of(unit.deployment).transit, {f"{unit.host_id}|create:dead": 1.0}
            )
            assert await admission.in_transit() == {}
            assert await async_redis.zcard(Keys.of(unit.deployment).transit) == 0
        finally:
            await async_redis.aclose()

    asyncio.run(scenario())


def test_a_new_rollouts_slot_is_in_transit_until_its_record_names_the_host(
    unit: Settings,
) -> None:
    """A cold start's slot is taken and counted in transit in one step, and leaves the
    transit set when the record counts it (settled) or the slot is given back: a recount
    in between (it reads records) kept the slot and a full host took one rollout too many
    (seen in a fresh-clone run of tests/e2e/test_reward_integrity.py)."""

    async def scenario() -> None:
        async_redis = aioredis.Redis.from_url(unit.redis_url, decode_responses=True)
        admission = Admission(unit, async_redis)
        beat = Heartbeat(
            host=unit.host_id, instance="i1", time=time.time(), schedulable=True, capacity=2
        )
        keys = Keys.of(unit.deployment)
        await async_redis.sadd(keys.hosts, unit.host_id)
        await async_redis.set(keys.heartbeat(unit.host_id), beat.model_dump_json(), ex=30)
        try:
            assert await admission.try_take("ro_one") == unit.host_id
            assert await admission.try_take("ro_two") == unit.host_id
            assert await admission.try_take("ro_three") is None  # full
            assert await admission.in_transit() == {unit.host_id: 2}
            # The reaper's recount now (no record yet) keeps both slots.

            async def records_count_none(in_transit: dict[str, int]) -> dict[str, int]:
                return in_transit

            assert await admission.recount(records_count_none)
            assert await admission.try_take("ro_three") is None
            await admission.settled(unit.host_id, "ro_one")
            await admission.release(unit.host_id, "ro_two")
            assert await admission.in_transit() == {}
            assert await admission.try_take("ro_three") == unit.host_id
        finally:
            await async_redis.aclose()

    asyncio.run(scenario())


def test_a_recount_during_which_slots_moved_writes_nothing(unit: Settings) -> None:
    """The recount reads the transit set, then the records, one key after another: a
    rollout that took its slot and settled in between (its record already read, its
    transit entry gone) was in neither, and writing that count gave its slot away: a host
    of four admitted a fifth (seen in a fresh-clone run of
    tests/e2e/test_reward_integrity.py). Such a pass must write nothing."""

    async def scenario() -> None:
        async_redis = aioredis.Redis.from_url(unit.redis_url, decode_responses=True)
        admission = Admission(unit, async_redis)
        beat = Heartbeat(
            host=unit.host_id, instance="i1", time=time.time(), schedulable=True, capacity=1
        )
        keys = Keys.of(unit.deployment)
        await async_redis.sadd(keys.hosts, unit.host_id)
        await async_redis.set(keys.heartbeat(unit.host_id), beat.model_dump_json(), ex=30)
        try:

            async def count_while_a_rollout_starts(in_transit: dict[str, int]) -> dict[str, int]:
                # The records are read here: none holds a slot yet. Meanwhile a new
                # rollout takes the host's one slot and its record settles it.
                assert await admission.try_take("ro_racer") == unit.host_id
                await admission.settled(unit.host_id, "ro_racer")
                return dict(in_transit)  # {}: the racer is in no place this pass read

            assert not await admission.recount(count_while_a_rollout_starts)
            assert await admission.loads() == {unit.host_id: 1}  # kept
            assert await admission.try_take("ro_late") is None  # the host is still full

            async def count_the_record(in_transit: dict[str, int]) -> dict[str, int]:
                return {**in_transit, unit.host_id: 1}  # the racer's record, read now

            assert await admission.recount(count_the_record)
            assert await admission.loads() == {unit.host_id: 1}
        finally:
            await async_redis.aclose()

    asyncio.run(scenario())


def test_a_sandbox_on_its_way_back_is_sent_once_and_pooled_once(unit: Settings) -> None:
    """Two closes of one rollout at once may not both recycle its sandbox: it would lie in
    its pool twice, and two rollouts would share it. Only the first hold is granted, the
    slot counts once in transit, and delivering the same sandbox twice pools it once."""

    async def scenario() -> None:
        sync = redis.Redis.from_url(unit.redis_url)
        async_redis = aioredis.Redis.from_url(unit.redis_url, decode_responses=True)
        admission = Admission(unit, async_redis)
        filler = PoolFiller(unit, sync)
        pool = PoolTarget(name="pooled:-", size=2, spec=SandboxSpec(image="x"))
        try:
            holds = await asyncio.gather(
                *(admission.hold_for_recycling(unit.host_id, "sbx-back") for _ in range(2))
            )
            assert sorted(bool(h) for h in holds) == [False, True], holds
            assert await admission.in_transit() == {unit.host_id: 1}
            member = next(h for h in holds if h)
            handle = _handle(unit, "sbx-back")
            for _ in range(2):
                assert filler.reserve(pool, 1) == 1
                filler.deliver(pool, handle, member)
            ready = sync.lrange(Keys.of(unit.deployment).pool(pool.name, "ready"), 0, -1)
            assert len(ready) == 1, ready
            assert await admission.in_transit() == {}
        finally:
            sync.close()
            await async_redis.aclose()

    asyncio.run(scenario())
