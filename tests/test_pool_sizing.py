"""How big a warm pool is (state/pools.py) and who goes first at a host's creation lane
(queue/worker.py): pure functions and real threads, no Redis."""

from __future__ import annotations

import threading

import pytest

from orchestrator.config import Settings
from orchestrator.environments.models import EnvironmentConfig
from orchestrator.queue.worker import CreationGate
from orchestrator.state.pools import PoolDemand, next_demand, pool_size, pooled_codebases

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
