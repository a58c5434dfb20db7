"""queue/lane.py: the creation lane seats a group's rollouts together, otherwise first come
first served, and a shutdown drops what has not started (on real threads); and the group a
rollout's creation carries (rollouts/models.rollout_group, state/wire.CreateSandbox). Every
end-to-end test's cold start goes through the lane with its group."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import cast

import pytest

from orchestrator.config import Settings
from orchestrator.queue import worker
from orchestrator.queue.lane import GroupedLane
from orchestrator.rollouts.models import rollout_group
from orchestrator.state.models import RolloutSource
from orchestrator.state.pools import PoolFiller
from orchestrator.state.wire import CreateSandbox, RunOp


class Recorder:
    """A lane of one worker held busy by a first job until ``release``, so the order of
    everything queued behind it is the lane's choice alone."""

    def __init__(self, lane: GroupedLane) -> None:
        self.lane = lane
        self.order: list[str] = []
        self.dropped: list[str] = []
        self.done = threading.Semaphore(0)
        self._gate = threading.Event()
        started = threading.Event()

        def hold() -> None:
            started.set()
            self._gate.wait(10)

        lane.submit(hold, None, dropped=lambda: None)
        assert started.wait(10)

    def add(self, name: str, group: str | None) -> None:
        def run() -> None:
            self.order.append(name)
            self.done.release()

        self.lane.submit(run, group, dropped=lambda: self.dropped.append(name))

    def release(self, count: int) -> list[str]:
        self._gate.set()
        for _ in range(count):
            assert self.done.acquire(timeout=10)
        return self.order


@pytest.fixture()
def lane() -> Iterator[GroupedLane]:
    made = GroupedLane(1, "test-create")
    yield made
    made.close()


def test_a_group_is_seated_together_and_groups_in_the_order_they_came(lane: GroupedLane) -> None:
    recorder = Recorder(lane)
    # Interleaved as a trainer's burst arrives: items a, b, c sampled n times each.
    for name in ("a1", "b1", "a2", "c1", "b2", "a3", "c2", "b3"):
        recorder.add(name, name[0])
    assert recorder.release(8) == ["a1", "a2", "a3", "b1", "b2", "b3", "c1", "c2"]


def test_work_of_no_group_keeps_its_place_in_arrival_order(lane: GroupedLane) -> None:
    recorder = Recorder(lane)
    for name, group in (("x", None), ("a1", "a"), ("y", None), ("a2", "a"), ("z", None)):
        recorder.add(name, group)
    # a2 goes ahead of y (queued after a's first member), never ahead of x.
    assert recorder.release(5) == ["x", "a1", "a2", "y", "z"]


def test_past_its_window_a_group_takes_its_turn_like_anyone() -> None:
    lane = GroupedLane(1, "test-create", group_window_s=0.0)
    try:
        recorder = Recorder(lane)
        for name in ("a1", "b1", "a2"):
            recorder.add(name, name[0])
        assert recorder.release(3) == ["a1", "b1", "a2"]
    finally:
        lane.close()


def test_a_shutdown_drops_what_has_not_started_and_refuses_more(lane: GroupedLane) -> None:
    recorder = Recorder(lane)
    recorder.add("a1", "a")
    recorder.add("b1", "b")
    lane.close()
    assert sorted(recorder.dropped) == ["a1", "b1"]
    recorder.add("late", None)
    assert recorder.dropped[-1] == "late"
    assert recorder.order == [] and lane.waiting() == 0


def test_rollouts_of_one_item_have_one_group() -> None:
    """Whatever order the row's keys came in; another row is another group; an E2B
    sandbox is in none; and the group is on the worker's side of the wire."""
    row = {"codebase": "requests", "question": "where is Session defined?", "n": [1, 2]}
    same = {"n": [1, 2], "question": "where is Session defined?", "codebase": "requests"}
    group = rollout_group(RolloutSource.AGENT_RFT, row)
    assert group is not None and group == rollout_group(RolloutSource.API, same)
    assert group != rollout_group(RolloutSource.AGENT_RFT, {**row, "question": "another"})
    assert rollout_group(RolloutSource.E2B, {"environment": "default"}) is None
    wire = CreateSandbox.model_validate(
        {"rollout_id": "r", "spec": {"image": "img", "rollout_id": "r"}, "group": group}
    )
    assert wire.group == group


class _Pools:
    """The pool filler's one question here: does a new rollout wait for this pool?"""

    def __init__(self, awaited: set[str]) -> None:
        self._awaited = awaited

    def awaited(self, pool: str) -> bool:
        return pool in self._awaited


def test_background_work_waits_for_the_hosts_calls_to_pause() -> None:
    """A refill or a reset waits while a call runs (and just after one), goes at once when
    a new rollout waits for the reset's pool, and waits no longer than its bound."""
    pools = cast(PoolFiller, _Pools({"awaited-pool"}))
    host = worker.Host(Settings(background_yield_s=0.6), pool_filler=pools)
    call = cast(RunOp, SimpleNamespace(ticket="t1"))  # (only its ticket is read)
    assert host.yield_to_calls("refill") < 0.05  # nothing runs
    with host.in_flight.running(call):
        assert 0.55 < host.yield_to_calls("refill") < 1.5  # its bound
        assert host.yield_to_calls("reset", "awaited-pool") < 0.05
    # Just after a call: the host is not quiet yet, then it is.
    waited = host.yield_to_calls("reset", "other-pool")
    assert 0.2 < waited < 0.55, waited
