"""How big a warm pool is (state/pool_sizing.py) and who goes first at a host's creation lane
(queue/worker.py): pure functions and real threads; and, on real Redis, the demand the
reaper records (rollouts/reaper.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from orchestrator.config import Settings
from orchestrator.environments.models import EnvironmentConfig
from orchestrator.queue.worker import CreationGate
from orchestrator.rollouts.reaper import _record_pool_demand
from orchestrator.state.keys import Keys
from orchestrator.state.models import RolloutSource, RolloutState
from orchestrator.state.pool_sizing import (
    PoolDemand,
    next_demand,
    parse_demand,
    peak_concurrency,
    pool_size,
    pooled_codebases,
)
from orchestrator.state.pools import PoolClaims
from orchestrator.state.records import Rollout, RolloutStore
from tests.redis_units import own_deployment, pool_handle

AUTO = Settings(pool_autosize=True, pool_headroom=0.1, pool_max_sandboxes=100)


BASE = {"name": "e", "tools": ["shell"], "grader": {"name": "file_f1"}}


def _env(**fields: object) -> EnvironmentConfig:
    return EnvironmentConfig.model_validate({**BASE, "codebase": "c", **fields})


def _seen(peak: int, at: float) -> PoolDemand:
    return PoolDemand(environment="e", codebase="c", peak=peak, at=at)


@pytest.mark.parametrize(
    ("fields", "peak", "size"),
    [
        ({}, 0, 0),  # nothing seen, nothing declared: no pool
        ({}, 10, 11),  # the peak plus 10 %
        ({}, 1, 2),  # rounded up: one spare at least
        ({"expected_concurrency": 64}, 0, 71),  # declared, before any demand
        ({"expected_concurrency": 64}, 200, 100),  # capped by pool_max_sandboxes
        ({"pool_size": 5}, 1, 5),  # never below a hand-set size
        ({"pool_size": 150}, 0, 150),  # a hand-set size above the cap is kept
        ({"pool_size": 5, "pool_autosize": False}, 50, 5),  # exactly the hand-set size
    ],
)
def test_pool_size(fields: dict[str, object], peak: int, size: int) -> None:
    assert pool_size(_env(**fields), AUTO, _seen(peak, 0) if peak else None) == size


def test_autosizing_off_for_the_deployment_keeps_the_hand_set_size() -> None:
    off = AUTO.model_copy(update={"pool_autosize": False})
    assert pool_size(_env(expected_concurrency=64), off, _seen(200, 0)) == 0
    assert pool_size(_env(pool_size=3), off, _seen(200, 0)) == 3


def test_a_peak_holds_for_the_window_then_gives_way() -> None:
    peak = _seen(50, at=100)
    assert next_demand(None, _seen(3, 101), 60) == _seen(3, 101)
    assert next_demand(peak, _seen(3, 150), 60) == peak, "within the window: the peak holds"
    assert next_demand(peak, _seen(60, 150), 60) == _seen(60, 150), "a new high replaces it"
    assert next_demand(peak, _seen(3, 161), 60) == _seen(3, 161), "past it: what is live"


def test_pooled_codebases_come_from_demand_for_a_dataset_codebase() -> None:
    env = EnvironmentConfig.model_validate(BASE)
    seen = {"e:a": PoolDemand(environment="e", codebase="a", peak=2, at=0)}
    seen["other:b"] = PoolDemand(environment="other", codebase="b", peak=9, at=0)
    assert pooled_codebases(env, AUTO, seen) == ["a"]
    assert pooled_codebases(env, AUTO.model_copy(update={"pool_autosize": False}), seen) == []


def test_a_pool_fill_waits_while_a_rollouts_creation_waits() -> None:
    gate = CreationGate()
    gate.rollout_queued()
    went = threading.Event()

    def fill() -> None:
        if gate.pool_turn():
            went.set()

    filler = threading.Thread(target=fill)
    filler.start()
    assert not went.wait(0.3), "a rollout's creation is waiting: the fill does not start"
    gate.rollout_done()
    assert went.wait(5), "no rollout waits any more: the fill goes"
    filler.join(5)


def test_a_closed_gate_releases_waiting_fills_without_their_turn() -> None:
    gate = CreationGate()
    gate.rollout_queued()
    turns: list[bool] = []
    filler = threading.Thread(target=lambda: turns.append(gate.pool_turn()))
    filler.start()
    gate.close()
    filler.join(5)
    assert turns == [False]


def test_the_peak_is_the_most_live_at_once_whatever_the_order() -> None:
    spans: list[tuple[str, float, float | None]] = [
        ("p", 0.0, 5.0),
        ("p", 1.0, 2.0),
        ("p", 2.0, None),  # starts as one closes: not beside it
        ("p", 3.0, 4.0),
        ("q", 10.0, 11.0),
    ]
    assert peak_concurrency(spans) == {"p": 3, "q": 1}
    assert peak_concurrency(list(reversed(spans))) == {"p": 3, "q": 1}
    assert peak_concurrency([]) == {}


def test_a_burst_that_ended_between_two_passes_counts_whole(
    settings: Settings, tmp_path: Path
) -> None:
    """Three rollouts that all ran at once and ended before the reaper's pass, beside one
    still live: the pass sees 1 live, and records a peak of 4. One created before the
    pass's horizon and closed long ago is not counted."""

    async def scenario(own: Settings) -> None:
        store = RolloutStore(own.redis_url, Keys.of(own.deployment))
        now = time.time()

        def record(rollout_id: str, created: float, closed: float | None) -> Rollout:
            return Rollout(
                rollout_id=rollout_id,
                source=RolloutSource.API,
                environment="e",
                codebase="c",
                image="img",
                state=RolloutState.ACTIVE,
                created_at=created,
                last_activity=created,
            ).model_copy(update={"closed_at": closed})

        try:
            for rollout in (
                record("old", now - 100, now - 90),
                record("a", now - 5, now - 1),
                record("b", now - 4, now - 1),
                record("c", now - 4, now - 2),
                record("live", now - 3, None),
            ):
                assert await store.create(rollout)
                if rollout.closed_at is not None:
                    await store.update(rollout.rollout_id, closed_at=rollout.closed_at)
            assert await store.live_ids() == ["live"]
            pools = PoolClaims(own, store.redis)
            await _record_pool_demand(store, pools, since=now - 20)
            raw = await store.redis.hgetall(Keys.of(own.deployment).pool_demand)
            assert parse_demand(raw)["e:c"].peak == 4
        finally:
            await store.close()

    with own_deployment(settings, "demand") as own:
        asyncio.run(scenario(own))


def test_the_recount_never_undoes_a_claim_made_during_its_pass(settings: Settings) -> None:
    """The reaper reads the live rollouts, then sets each pool's count of sandboxes out with
    rollouts; a claim in between (it comes before its rollout's record) was not in what it
    read. Set anyway, the count fell to 0 with the sandbox out, a refill made another, and
    the claimed one, recycled, found its pool full and was destroyed (make flake-hunt's
    repeats of tests/e2e/test_recycling.py). A quiet pass still corrects the count."""

    async def scenario(own: Settings) -> None:
        store = RolloutStore(own.redis_url, Keys.of(own.deployment))
        keys = Keys.of(own.deployment)
        out = keys.pool("e:c", "out")
        live: list[tuple[str, str | None]] = [("e", "c")]
        try:
            pools = PoolClaims(own, store.redis)
            await pools.record_demand(live, [], await pools.out_changes())
            assert await store.redis.get(out) == "1"
            before = await pools.out_changes()  # a pass begins, reads one rollout live
            await pools._claimed("e:c", _handle_json())  # a claim, its record not yet made
            await pools.record_demand(live, [], before)
            assert await store.redis.get(out) == "2", "the claim was undone"
            assert 0 < await store.redis.ttl(out) <= max(30, 3 * own.reaper_interval_s)
            before = await pools.out_changes()  # reads two live
            await pools.returned("e", "c")  # one ends meanwhile
            await pools.record_demand(live * 2, [], before)
            assert await store.redis.get(out) == "1", "the return was undone"
            # A pass with no claim or return during it sets the count it read.
            await pools.record_demand([], [], await pools.out_changes())
            assert await store.redis.get(out) == "0"
        finally:
            await store.close()

    with own_deployment(settings, "recount") as own:
        asyncio.run(scenario(own))


def _handle_json() -> str:
    return pool_handle("h", "sbx-000000000001").model_dump_json()
