"""A new rollout that finds its pool empty while a sandbox is being reset for that pool
waits for it rather than making a cold one beside it (PoolClaims.take_recycled), on real
Redis: one waiter per reset, a reset that ends destroyed lets its waiter go at once, and a
refill leaves room for the sandboxes on their way back."""

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
from orchestrator.state.keys import Keys
from orchestrator.state.pool_sizing import PoolTarget, pool_name
from orchestrator.state.pools import PoolClaims, PoolFiller
from tests.redis_units import POOLED_ENVIRONMENT, own_deployment, pool_handle

POOL = pool_name("pooled", None)


@pytest.fixture
def unit(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    path = tmp_path_factory.mktemp("recycle-wait") / "environments.yaml"
    path.write_text(POOLED_ENVIRONMENT)
    with own_deployment(settings, "rw", path) as own:
        yield own


def _handle(settings: Settings, sandbox_id: str) -> SandboxHandle:
    return pool_handle(settings.host_id, sandbox_id, "orchestrator/sandbox-base:latest")


def _resolved(settings: Settings) -> ResolvedEnvironment:
    return load_environments(settings).resolve({"environment": "pooled"})


class Sides:
    """The API's claims (async) and a worker's filler (sync, run in a thread), as in the
    product, on one deployment's keys."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.sync = redis.Redis.from_url(settings.redis_url)
        self.aio = aioredis.Redis.from_url(settings.redis_url, decode_responses=True)
        self.claims = PoolClaims(settings, self.aio)
        self.filler = PoolFiller(settings, self.sync)
        self.target = PoolTarget(name=POOL, size=2, spec=SandboxSpec(image="x"), recycles=True)
        self.keys = Keys.of(settings.deployment)

    async def back_after(
        self, delay_s: float, handle: SandboxHandle | None, sandbox_id: str
    ) -> None:
        """The worker's end of a reset after ``delay_s``: the sandbox pooled (or, None,
        destroyed), then out of the recycling set."""
        await asyncio.sleep(delay_s)

        def finish() -> None:
            if handle is not None:
                assert self.filler.reserve(self.target, 1) == 1
                self.filler.deliver(self.target, handle)
            self.filler.recycled(POOL, sandbox_id)

        await asyncio.to_thread(finish)

    async def awaiting(self) -> int:
        return int(await self.aio.get(self.keys.pool(POOL, "awaiting")) or 0)

    async def close(self) -> None:
        await self.aio.aclose()
        self.sync.close()


def test_an_empty_pool_waits_for_the_sandbox_being_reset_for_it(unit: Settings) -> None:
    async def scenario() -> None:
        sides = Sides(unit)
        resolved = _resolved(unit)
        try:
            assert await sides.claims.take(resolved) is None
            await sides.claims.recycling(POOL, "sbx-back")
            back = asyncio.create_task(sides.back_after(0.3, _handle(unit, "sbx-back"), "sbx-back"))
            started = time.monotonic()
            got = await sides.claims.take_recycled(resolved, wait_s=10)
            waited = time.monotonic() - started
            await back
            assert got is not None and got.sandbox_id == "sbx-back"
            assert 0.3 <= waited < 5, waited
            # Claimed as any pool sandbox is: out with its rollout, its slot in transit.
            assert int(await sides.aio.get(sides.keys.pool(POOL, "out")) or 0) == 1
            assert await sides.aio.zcard(sides.keys.transit) == 1
            assert await sides.awaiting() == 0
            assert await sides.aio.zcard(sides.keys.pool(POOL, "recycling")) == 0
        finally:
            await sides.close()

    asyncio.run(scenario())


def test_one_waiter_per_reset_and_the_rest_go_cold_at_once(unit: Settings) -> None:
    async def scenario() -> None:
        sides = Sides(unit)
        resolved = _resolved(unit)
        try:
            await sides.claims.recycling(POOL, "sbx-one")
            back = asyncio.create_task(sides.back_after(0.5, _handle(unit, "sbx-one"), "sbx-one"))

            async def timed() -> tuple[SandboxHandle | None, float]:
                started = time.monotonic()
                got = await sides.claims.take_recycled(resolved, wait_s=10)
                return got, time.monotonic() - started

            results = await asyncio.gather(*(timed() for _ in range(4)))
            await back
            served = [(got, s) for got, s in results if got is not None]
            refused = [s for got, s in results if got is None]
            assert len(served) == 1 and served[0][0] is not None
            assert served[0][0].sandbox_id == "sbx-one"
            # Three found no reset left to count on: they did not wait for it.
            assert len(refused) == 3 and max(refused) < 0.25, refused
            assert await sides.awaiting() == 0
        finally:
            await sides.close()

    asyncio.run(scenario())


def test_a_reset_that_ends_destroyed_lets_its_waiter_go(unit: Settings) -> None:
    async def scenario() -> None:
        sides = Sides(unit)
        resolved = _resolved(unit)
        try:
            await sides.claims.recycling(POOL, "sbx-dirty")
            back = asyncio.create_task(sides.back_after(0.3, None, "sbx-dirty"))
            started = time.monotonic()
            got = await sides.claims.take_recycled(resolved, wait_s=10)
            waited = time.monotonic() - started
            await back
            assert got is None
            assert waited < 2, "gone with the reset, not at the end of its wait"
            assert await sides.awaiting() == 0
        finally:
            await sides.close()

    asyncio.run(scenario())


def test_a_reset_that_ended_after_the_pool_was_found_empty_is_taken(unit: Settings) -> None:
    """The rollout found the pool empty; before it asked for a reset to wait for, the last
    one ended, its sandbox delivered and no longer counted as resetting. It takes that
    sandbox, not a cold one beside it (make flake-hunt's repeats of tests/e2e/
    test_recycling.py: a rollout started cold 14 ms after the sandbox came back)."""

    async def scenario() -> None:
        sides = Sides(unit)
        resolved = _resolved(unit)
        handle = _handle(unit, "sbx-000000000042")
        try:
            assert await sides.claims.take(resolved) is None  # the pool is empty
            await sides.claims.recycling(POOL, handle.sandbox_id)
            await sides.back_after(0, handle, handle.sandbox_id)  # delivered, then uncounted
            taken = await sides.claims.take_recycled(resolved, wait_s=10)
            assert taken is not None and taken.sandbox_id == handle.sandbox_id
            assert await sides.awaiting() == 0
        finally:
            await sides.close()

    asyncio.run(scenario())


def test_a_wait_is_bounded_and_none_without_a_reset(unit: Settings) -> None:
    async def scenario() -> None:
        sides = Sides(unit)
        resolved = _resolved(unit)
        try:
            started = time.monotonic()
            assert await sides.claims.take_recycled(resolved, wait_s=10) is None
            assert time.monotonic() - started < 0.25, "no reset under way: no wait"
            await sides.claims.recycling(POOL, "sbx-stuck")
            assert await sides.claims.take_recycled(resolved, wait_s=0) is None
            started = time.monotonic()
            assert await sides.claims.take_recycled(resolved, wait_s=0.4) is None
            assert 0.4 <= time.monotonic() - started < 2
            assert await sides.awaiting() == 0
        finally:
            await sides.close()

    asyncio.run(scenario())


def test_a_refill_leaves_room_for_the_sandboxes_being_reset(unit: Settings) -> None:
    async def scenario() -> None:
        sides = Sides(unit)
        try:
            assert await asyncio.to_thread(sides.filler.refill_size, sides.target) == 2
            await sides.claims.recycling(POOL, "sbx-a")
            assert await asyncio.to_thread(sides.filler.refill_size, sides.target) == 1
            await asyncio.to_thread(sides.filler.recycled, POOL, "sbx-a")
            assert await asyncio.to_thread(sides.filler.refill_size, sides.target) == 2
        finally:
            await sides.close()

    asyncio.run(scenario())


def test_stocked_pools_come_from_their_index_not_a_scan(unit: Settings) -> None:
    """The reaper's recount and ``orchestrator status`` list pools from an index the
    delivery keeps: a pool is listed while its ready list exists, leaves the index with its
    last sandbox, and a ready list a release before the index made is indexed once."""

    async def scenario() -> None:
        sides = Sides(unit)
        resolved = _resolved(unit)
        try:
            assert await sides.claims.stocked() == []
            await asyncio.to_thread(sides.filler.reserve, sides.target, 1)
            await asyncio.to_thread(sides.filler.deliver, sides.target, _handle(unit, "sbx-a"))
            assert await sides.claims.stocked() == [POOL]
            assert await sides.aio.smembers(sides.keys.pools_stocked) == {POOL}

            taken = await sides.claims.take(resolved)
            assert taken is not None and taken.sandbox_id == "sbx-a"
            assert await sides.claims.stocked() == []
            assert await sides.aio.exists(sides.keys.pools_stocked) == 0

            # An upgrade: a ready list without the index, and no mark that it was made.
            older = sides.keys.pool("older:-", "ready")
            await sides.aio.rpush(older, _handle(unit, "sbx-old").model_dump_json())
            await sides.aio.delete(sides.keys.pools_indexed)
            assert await sides.claims.stocked() == ["older:-"]
            assert await sides.aio.get(sides.keys.pools_indexed) == "1"
        finally:
            await sides.close()

    asyncio.run(scenario())
