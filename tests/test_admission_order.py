"""Admission is first come first served, on real Redis: past capacity, new rollouts wait
in the admission queue and are seated in the order they came, a GRPO group's together; a
rollout that arrives while others wait, and a pool's refill, never take a slot one of
them wants."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from orchestrator.config import Settings
from orchestrator.state.admission import Admission
from orchestrator.state.heartbeat import Heartbeat
from orchestrator.state.keys import Keys
from orchestrator.state.pools import PoolFiller
from tests.redis_units import own_deployment


@pytest.fixture
def unit(settings: Settings) -> Iterator[Settings]:
    with own_deployment(settings, "fcfs") as own:
        yield own


async def _one_host(client: aioredis.Redis, settings: Settings, capacity: int) -> None:
    beat = Heartbeat(
        host=settings.host_id, instance="i1", time=time.time(), schedulable=True, capacity=capacity
    )
    keys = Keys.of(settings.deployment)
    await client.sadd(keys.hosts, settings.host_id)
    await client.set(keys.heartbeat(settings.host_id), beat.model_dump_json(), ex=60)


async def _queued(admission: Admission, count: int) -> None:
    """Until ``count`` rollouts wait in the admission queue."""
    deadline = time.monotonic() + 10
    while await admission.waiting(time.time()) < count:
        assert time.monotonic() < deadline, "the waiters never queued"
        await asyncio.sleep(0.01)


async def _seat_one_by_one(
    admission: Admission,
    unit: Settings,
    arrivals: list[Coroutine[Any, Any, None]],
    seated: list[str],
) -> None:
    """Start each of ``arrivals`` (a waiter for a slot) once the one before it waits, a
    little apart (distinct deadlines: the arrival order is clear); then free one slot at
    a time, each only once a waiter was seated in the one before."""
    waiters = []
    for n, arrival in enumerate(arrivals):
        waiters.append(asyncio.create_task(arrival))
        await _queued(admission, n + 1)
        await asyncio.sleep(0.01)
    for count in range(1, len(arrivals) + 1):
        await admission.release(unit.host_id)
        deadline = time.monotonic() + 10
        while len(seated) < count:
            assert time.monotonic() < deadline, seated
            await asyncio.sleep(0.01)
    await asyncio.gather(*waiters)


def test_a_group_s_waiters_are_seated_together(unit: Settings) -> None:
    """Waiters of items a and b arrive interleaved (a1, b1, a2, b2, none): a2 is seated
    right after a1, ahead of b1 who came before it; a waiter of no group keeps its
    place in arrival order."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(unit.redis_url, decode_responses=True)
        admission = Admission(unit, client)
        await _one_host(client, unit, capacity=1)
        seated: list[str] = []

        async def start(holder: str, group: str | None) -> None:
            await admission.take(holder, wait_s=20, group=group)
            seated.append(holder)

        try:
            assert await admission.try_take("ro_running") == unit.host_id
            arrivals = (("a1", "a"), ("b1", "b"), ("a2", "a"), ("b2", "b"), ("none", None))
            waiters = [start(holder, group) for holder, group in arrivals]
            await _seat_one_by_one(admission, unit, waiters, seated)
            # a1 and a2 share a score (their order between them is the member's): a group.
            assert set(seated[:2]) == {"a1", "a2"} and set(seated[2:4]) == {"b1", "b2"}
            assert seated[4] == "none", seated
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_waiters_are_seated_in_the_order_they_came(unit: Settings) -> None:
    async def scenario() -> None:
        client = aioredis.Redis.from_url(unit.redis_url, decode_responses=True)
        admission = Admission(unit, client)
        await _one_host(client, unit, capacity=1)
        seated: list[str] = []

        async def start(holder: str) -> None:
            await admission.take(holder, wait_s=20)
            seated.append(holder)

        try:
            assert await admission.try_take("ro_running") == unit.host_id
            waiters = []
            for n, holder in enumerate(("ro_first", "ro_second", "ro_third")):
                waiters.append(asyncio.create_task(start(holder)))
                await _queued(admission, n + 1)
            for expected in ("ro_first", "ro_second", "ro_third"):
                # A slot comes free; a rollout arriving now finds it kept for the queue.
                await admission.release(unit.host_id)
                assert await admission.try_take("ro_late") is None
                deadline = time.monotonic() + 10
                while expected not in seated:
                    assert time.monotonic() < deadline, seated
                    await asyncio.sleep(0.01)
                assert seated[-1] == expected, seated
            await asyncio.gather(*waiters)
            assert seated == ["ro_first", "ro_second", "ro_third"]
            # The queue is empty: a new arrival takes a free slot at once.
            await admission.release(unit.host_id)
            assert await admission.try_take("ro_late") == unit.host_id
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_only_free_slots_beyond_the_waiters_go_to_others(unit: Settings) -> None:
    """Two free slots and one waiter: one slot is the waiter's, the other anyone's, a
    pool's refill included."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(unit.redis_url, decode_responses=True)
        sync = redis.Redis.from_url(unit.redis_url)
        admission = Admission(unit, client)
        filler = PoolFiller(unit.model_copy(update={"host_max_sandboxes": 3}), sync)
        await _one_host(client, unit, capacity=3)
        try:
            for holder in ("ro_a", "ro_b", "ro_c"):
                assert await admission.try_take(holder) == unit.host_id
            waiter = asyncio.create_task(admission.take("ro_waiting", wait_s=20))
            await _queued(admission, 1)
            await admission.release(unit.host_id)
            assert filler.take_slot("create:refill") is None, "the waiter's slot"
            assert await admission.try_take("ro_new") is None
            await admission.release(unit.host_id)
            assert await admission.try_take("ro_new") == unit.host_id
            assert await waiter == unit.host_id
            assert await admission.waiting(time.time()) == 0
        finally:
            await client.aclose()
            sync.close()

    asyncio.run(scenario())


def test_tenants_are_seated_by_their_fair_share(unit: Settings) -> None:
    """Tenant A holds three sandboxes of the host's four and three of its rollouts wait;
    tenant B, holding none, comes later with two. As slots come free, B's two are seated
    first (it holds fewer), then A's in the order they came: one tenant's burst cannot
    hold every slot. A waiter has entered its tenant's held set before it waits, as a
    start does (state/quotas.py)."""

    async def scenario() -> None:
        client = aioredis.Redis.from_url(unit.redis_url, decode_responses=True)
        admission = Admission(unit, client)
        keys = Keys.of(unit.deployment)
        await _one_host(client, unit, capacity=4)
        seated: list[str] = []

        async def start(holder: str, tenant: str) -> None:
            await client.zadd(keys.tenant_sandboxes(tenant), {holder: time.time()})
            await admission.take(holder, wait_s=20, tenant=tenant)
            seated.append(holder)

        try:
            for n in range(3):
                await client.zadd(keys.tenant_sandboxes("a"), {f"a-held{n}": time.time()})
                assert await admission.try_take(f"a-held{n}", tenant="a") == unit.host_id
            assert await admission.try_take("b-other", tenant="default") == unit.host_id
            arrivals = (("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b"), ("b2", "b"))
            waiters = [start(holder, tenant) for holder, tenant in arrivals]
            await _seat_one_by_one(admission, unit, waiters, seated)
            assert seated == ["b1", "b2", "a1", "a2", "a3"]
            assert await client.scard(keys.waiting_tenants) in (0, 1, 2)
            for tenant in ("a", "b"):
                assert await client.zcard(keys.tenant_waiting(tenant)) == 0
        finally:
            await client.aclose()

    asyncio.run(scenario())
