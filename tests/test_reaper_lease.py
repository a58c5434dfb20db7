"""The reaper as a process of its own (rollouts/reaper.Reaper) against a real Redis: of
several reapers of a deployment one holds the lease and reaps, the others stand by; a
reaper that stops gives the lease up and a standby reaps at its next turn; a reaper that
died without giving it up is replaced once the lease lapses. The passes are the real ones
(an empty deployment: nothing to end, no host to sweep)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from orchestrator.config import Settings
from orchestrator.rollouts.reaper import Reaper
from orchestrator.state.forget import forget_deployment
from orchestrator.state.records import RolloutStore

pytestmark = pytest.mark.anyio


@pytest.fixture()
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture()
def reaper_settings(settings: Settings) -> Iterator[Settings]:
    own = settings.model_copy(
        update={
            "deployment": f"{settings.deployment}-reaper-{uuid.uuid4().hex[:6]}",
            "reaper_interval_s": 0.05,
        }
    )
    yield own
    forget_deployment(own.redis_url, own.deployment)


@pytest.fixture()
async def store(reaper_settings: Settings) -> AsyncIterator[RolloutStore]:
    store = RolloutStore.connect(reaper_settings, role="test")
    yield store
    await store.close()


class CountingReaper(Reaper):
    """The real reaper, counting its passes."""

    def __init__(self, settings: Settings, holder: str) -> None:
        super().__init__(settings, holder=holder)
        self.passes = 0

    async def pass_once(self) -> dict[str, Any]:
        self.passes += 1
        return await super().pass_once()


async def _until(what: str, done: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_the_lease_has_one_holder_renewed_given_up_or_lapsed(store: RolloutStore) -> None:
    assert await store.hold_reaper_lease("a", 5)
    assert not await store.hold_reaper_lease("b", 5)
    assert await store.hold_reaper_lease("a", 5), "its holder renews it"
    await store.drop_reaper_lease("b")  # not b's to give up: nothing changes
    assert not await store.hold_reaper_lease("b", 5)
    await store.drop_reaper_lease("a")
    assert await store.hold_reaper_lease("b", 0.2)
    await asyncio.sleep(0.4)  # b died without giving it up: it lapses
    assert await store.hold_reaper_lease("a", 5)


async def test_one_of_two_reapers_reaps_and_the_standby_takes_over_when_it_stops(
    reaper_settings: Settings, store: RolloutStore
) -> None:
    first = CountingReaper(reaper_settings, "first")
    second = CountingReaper(reaper_settings, "second")
    stop_first, stop_second = asyncio.Event(), asyncio.Event()
    running_first = asyncio.create_task(first.run(stop_first))
    await _until("the first reaper's passes", lambda: first.passes >= 3)
    running_second = asyncio.create_task(second.run(stop_second))
    # Five more passes of the holder: as many turns of the standby, each refused the lease.
    passed = first.passes
    await _until("more passes of the holder", lambda: first.passes >= passed + 5)
    assert second.passes == 0, "a standby never reaps while the lease is held"
    # The holder stops: it gives the lease up, and the standby reaps at its next turn,
    # not when the lease would have lapsed.
    stopped = time.monotonic()
    stop_first.set()
    await running_first
    await _until("the standby to take over", lambda: second.passes >= 1)
    assert time.monotonic() - stopped < first.lease_s / 2
    last_pass = await store.redis.get(store.keys.reaper_pass)
    assert last_pass is not None and float(last_pass) > time.time() - 5
    stop_second.set()
    await running_second
    assert await store.hold_reaper_lease("anyone", 1), "a stopped reaper holds nothing"
