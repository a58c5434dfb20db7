"""The read model of the deployment's state (state/snapshot.py) against a real Redis (no
stack): the gauges its collector reports from the keys the code keeps, what a scrape costs
with 1000 live rollouts, that Redis down is a gauge, not an error; that one read gives the
gauges and the status view the same numbers, and the view's own reads beside it. Also the
API's multiprocess directory and the HTTP route label."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import redis
import yaml
from prometheus_client.metrics_core import Metric

from orchestrator.api.middleware import UNMATCHED, UNROUTED, route_template
from orchestrator.config import Settings
from orchestrator.environments.loader import default_environments_text, parse_environments
from orchestrator.local import free_port
from orchestrator.observability.api_process import multiproc_dir, prepare_multiproc_dir
from orchestrator.observability.metrics import MULTIPROC_ENV
from orchestrator.sandbox.backend import SandboxHandle
from orchestrator.state.collector import StateCollector, gauges
from orchestrator.state.forget import forget_deployment
from orchestrator.state.heartbeat import Heartbeat
from orchestrator.state.keys import Keys
from orchestrator.state.records import InfraFailureEntry, RolloutStore
from orchestrator.state.snapshot import NEWEST, StateReader
from orchestrator.views.models import AdmissionView, StatusSnapshot
from orchestrator.views.state import read_state, status_of
from tests.redis_units import pool_handle

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def keys_of(settings: Settings) -> Keys:
    return Keys.of(settings.deployment)


def collect(collector: StateCollector) -> Samples:
    return samples(collector.collect())


def samples(families: Iterable[Metric]) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in families
        for s in family.samples
    }


def labelled(got: Samples, name: str) -> dict[str, float]:
    """The samples of a gauge with one label, by that label's value."""
    return {labels[0][1]: v for (n, labels), v in got.items() if n == name}


@pytest.fixture()
def deployment(settings: Settings, tmp_path: Path) -> Iterator[Settings]:
    own = Settings(
        deployment=f"{settings.deployment}-unit-{uuid.uuid4().hex[:8]}", state_dir=tmp_path
    )
    yield own
    # The deployment's keys and its queues' (a priority sub-queue too: its own key).
    forget_deployment(own.redis_url, own.deployment)


def _pooled_environments(settings: Settings) -> str:
    data = yaml.safe_load(default_environments_text())
    for env in data["environments"]:
        if env["name"] == "codebase-planning":
            env.update({"pool_size": 3, "pool_codebases": ["alpha", "beta"]})
    return yaml.safe_dump(data)


def _handle(host: str, sandbox_id: str) -> SandboxHandle:
    return pool_handle(host, sandbox_id)


def _populate(settings: Settings, live: int) -> None:
    """Keys as the worker, store, pools, admission and Celery keep them."""
    client = redis.Redis.from_url(settings.redis_url)
    p = keys_of(settings).prefix
    pipe = client.pipeline(transaction=False)
    now = time.time()
    for host, schedulable, backend_ok in (("h-a", True, True), ("h-b", False, False)):
        beat = Heartbeat(
            host=host,
            instance="i1",
            time=now,
            schedulable=schedulable,
            backend_ok=backend_ok,
            capacity=100,
        )
        pipe.set(f"{p}worker:{host}", beat.model_dump_json(), ex=60)
        pipe.sadd(f"{p}hosts", host)
    pipe.sadd(f"{p}hosts", "h-gone")  # known once, no heartbeat now
    pipe.hset(f"{p}host-rollouts", mapping={"h-a": 7, "h-b": 2, "h-gone": 5})
    now = time.time()
    pipe.zadd(f"{p}admission-waiting", {"w1": now + 60, "w2": now + 60, "stale": now - 5})
    for n in range(live):
        rollout_id = f"r{n}"
        host = "h-a" if n % 4 else "h-b"
        # Every tenth is still creating (no sandbox yet), one in ten is graded (its sandbox
        # kept until it closes); the lower the number, the newer.
        state = "creating" if n % 10 == 0 else "graded" if n % 10 == 5 else "active"
        sandbox = "null" if n % 10 == 0 else _handle(host, f"s{n}").model_dump_json()
        pipe.hset(
            f"{p}rollout:{rollout_id}",
            mapping={
                "rollout_id": rollout_id,
                "source": "api",
                "environment": "codebase-planning",
                "image": "img",
                "state": state,
                "host": host,
                "sandbox": sandbox,
                "created_at": now - n,
                "last_activity": now,
            },
        )
        pipe.zadd(f"{p}rollouts:live", {rollout_id: now})
    ready = f"{p}pool:codebase-planning:alpha:ready"
    pipe.rpush(
        ready, _handle("h-a", "p1").model_dump_json(), _handle("h-b", "p2").model_dump_json()
    )
    pipe.rpush(keys_of(settings).shared_queue, "m1", "m2")
    pipe.rpush(keys_of(settings).host_queue("h-a"), "m3")
    pipe.rpush(f"{keys_of(settings).host_queue('h-a')}\x06\x169", "m4")  # a priority sub-queue
    pipe.execute()
    client.close()


def test_state_gauges_from_redis(deployment: Settings) -> None:
    environments = parse_environments(_pooled_environments(deployment), deployment)
    collector = StateCollector(deployment, environments)
    _populate(deployment, live=40)
    try:
        got = collect(collector)
    finally:
        collector.close()
    assert got[("orchestrator_redis_up", ())] == 1
    assert got[("orchestrator_workers_up", ())] == 2
    assert got[("orchestrator_host_schedulable", (("host", "h-a"),))] == 1
    assert got[("orchestrator_host_schedulable", (("host", "h-b"),))] == 0
    assert got[("orchestrator_host_healthy", (("host", "h-b"),))] == 0
    assert ("orchestrator_host_healthy", (("host", "h-gone"),)) not in got
    assert got[("orchestrator_capacity_slots", (("state", "total"),))] == 200
    assert got[("orchestrator_capacity_slots", (("state", "used"),))] == 9
    assert got[("orchestrator_admission_waiting", ())] == 2
    assert got[("orchestrator_rollouts_live", ())] == 40
    # 40 live: 10 on h-b (n % 4 == 0), 4 creating (n % 10 == 0; all of them on h-b or h-a).
    env = "codebase-planning"
    on_a = sum(1 for n in range(40) if n % 4 and n % 10)
    on_b = sum(1 for n in range(40) if not n % 4 and n % 10)
    assert got[("orchestrator_sandboxes_active", (("environment", env), ("host", "h-a")))] == (
        on_a + 1  # and a ready pool sandbox
    )
    assert got[("orchestrator_sandboxes_active", (("environment", env), ("host", "h-b")))] == (
        on_b + 1
    )
    assert got[("orchestrator_pool_ready", (("environment", env),))] == 2
    assert got[("orchestrator_pool_target", (("environment", env),))] == 6
    shared = keys_of(deployment).shared_queue
    assert got[("orchestrator_queue_depth", (("queue", shared),))] == 2
    assert (
        got[
            (
                "orchestrator_queue_depth",
                (("queue", keys_of(deployment).host_queue("h-a")),),
            )
        ]
        == 2
    )
    assert (
        got[
            (
                "orchestrator_queue_depth",
                (("queue", keys_of(deployment).host_queue("h-b")),),
            )
        ]
        == 0
    )


def test_state_collector_cost_with_1000_live_rollouts(
    deployment: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    environments = parse_environments(default_environments_text(), deployment)
    collector = StateCollector(deployment, environments)
    _populate(deployment, live=1000)
    try:
        collect(collector)  # connection made
        runs = []
        for _ in range(20):
            started = time.perf_counter()
            got = collect(collector)
            runs.append(time.perf_counter() - started)
    finally:
        collector.close()
    assert got[("orchestrator_rollouts_live", ())] == 1000
    runs.sort()
    with capsys.disabled():
        print(
            f"\nstate collect, 1000 live rollouts: p50 {runs[10] * 1000:.1f} ms, "
            f"max {runs[-1] * 1000:.1f} ms"
        )


def test_redis_down_is_a_gauge_not_an_error(deployment: Settings) -> None:
    down = deployment.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"})
    environments = parse_environments(default_environments_text(), down)
    collector = StateCollector(down, environments)
    try:
        got = collect(collector)
    finally:
        collector.close()
    assert got == {("orchestrator_redis_up", ()): 0}


def test_one_read_gives_the_gauges_and_the_status_view_the_same_numbers(
    deployment: Settings,
) -> None:
    environments = parse_environments(_pooled_environments(deployment), deployment)
    _populate(deployment, live=40)
    reader = StateReader(deployment, environments)
    try:
        state = reader.read()
    finally:
        reader.close()
    got = samples(gauges(state))
    status = status_of(state)

    alive = {h.host: h for h in status.hosts if h.alive}
    assert got[("orchestrator_workers_up", ())] == len(alive) == 2
    assert labelled(got, "orchestrator_host_schedulable") == {
        host: int(view.schedulable) for host, view in alive.items()
    }
    assert labelled(got, "orchestrator_host_healthy") == {
        host: int(view.healthy) for host, view in alive.items()
    }
    # A host that stopped beating still holds slots: the view lists it, and neither counts
    # them among the live hosts' slots.
    (gone,) = [h for h in status.hosts if not h.alive]
    assert (gone.host, gone.slots_used) == ("h-gone", 5)
    assert status.admission == AdmissionView(
        waiting=int(got[("orchestrator_admission_waiting", ())]),
        slots_used=int(got[("orchestrator_capacity_slots", (("state", "used"),))]),
        slots_total=int(got[("orchestrator_capacity_slots", (("state", "total"),))]),
    )
    assert status.admission == AdmissionView(waiting=2, slots_used=9, slots_total=200)

    assert got[("orchestrator_rollouts_live", ())] == status.live_rollouts == 40
    assert sum(h.live_rollouts for h in status.hosts) == 40
    assert status.sandboxes.rollouts_by_state == {"creating": 4, "graded": 4, "active": 32}
    # Sandboxes held: every live rollout's but the creating ones', and the ready pool ones.
    active = sum(v for (n, _), v in got.items() if n == "orchestrator_sandboxes_active")
    assert active == 40 - 4 + status.sandboxes.pool_ready
    assert labelled(got, "orchestrator_queue_depth") == {q.queue: q.depth for q in status.queues}
    environments_pooled = labelled(got, "orchestrator_pool_target")
    assert {p.environment for p in status.pools} == set(environments_pooled)
    for environment, target in environments_pooled.items():
        pools = [p for p in status.pools if p.environment == environment]
        assert target == sum(p.target or 0 for p in pools)
        assert labelled(got, "orchestrator_pool_ready")[environment] == sum(p.ready for p in pools)
    assert sum(labelled(got, "orchestrator_pool_ready").values()) == status.sandboxes.pool_ready


def test_the_status_view_reads_its_own_extras_beside_the_read_model(
    deployment: Settings,
) -> None:
    """The newest live rollouts' summaries, pools no longer configured, recent failures:
    read by the view alone, beside the one snapshot it shares with the gauges."""
    environments = parse_environments(_pooled_environments(deployment), deployment)
    _populate(deployment, live=30)
    keys = keys_of(deployment)
    client = redis.Redis.from_url(deployment.redis_url)
    # A pool of an environment no longer configured, still holding a sandbox.
    client.rpush(keys.pool("retired:-", "ready"), _handle("h-a", "old").model_dump_json())
    failure = InfraFailureEntry(rollout_id="r7", cause="sandbox_dead", message="gone", at=1.0)
    client.lpush(keys.infra_failures, failure.model_dump_json())
    client.close()

    async def read() -> StatusSnapshot:
        reader = StateReader(deployment, environments, role="cli")
        store = RolloutStore.connect(deployment, role="cli")
        try:
            return await read_state(reader, store)
        finally:
            reader.close()
            await store.close()

    status = asyncio.run(read())
    assert status.redis_ok and status.live_rollouts == 30
    assert [s.rollout_id for s in status.newest_live] == [f"r{n}" for n in range(NEWEST)]
    assert status.newest_live[1].state == "active" and status.newest_live[1].host == "h-a"
    (retired,) = [p for p in status.pools if p.pool == "retired:-"]
    assert (retired.environment, retired.codebase, retired.ready, retired.target) == (
        "retired",
        None,
        1,
        None,
    )
    assert status.sandboxes.pool_ready == 2 + 1  # the configured pool's two, and this one
    assert status.recent_failures == [failure]


def test_the_status_view_of_a_redis_down_says_so(deployment: Settings) -> None:
    down = deployment.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"})

    async def read() -> StatusSnapshot:
        reader = StateReader(down, parse_environments(default_environments_text(), down))
        store = RolloutStore.connect(down, role="cli")
        try:
            return await read_state(reader, store)
        finally:
            reader.close()
            await store.close()

    status = asyncio.run(read())
    assert not status.redis_ok and status.redis_error
    assert status.hosts == [] and status.admission is None


def test_multiproc_dir_is_wiped_once_at_the_parent_start(deployment: Settings) -> None:
    previous = os.environ.pop(MULTIPROC_ENV, None)
    try:
        assert prepare_multiproc_dir(deployment, workers=1) is None
        path = multiproc_dir(deployment)
        path.mkdir(parents=True)
        (path / "counter_123.db").write_bytes(b"old")
        (path / "notes.txt").write_text("not ours to remove")
        assert prepare_multiproc_dir(deployment, workers=2) == path
        assert sorted(p.name for p in path.iterdir()) == ["notes.txt"]
        assert os.environ[MULTIPROC_ENV] == str(path)  # the worker processes inherit it
    finally:
        os.environ.pop(MULTIPROC_ENV, None)
        if previous is not None:
            os.environ[MULTIPROC_ENV] = previous


def test_route_label_is_the_template_or_a_fixed_word() -> None:
    class Route:
        path = "/v1/rollouts/{rollout_id}"

    assert route_template({"route": Route()}, 404) == "/v1/rollouts/{rollout_id}"
    assert route_template({}, 404) == UNMATCHED
    assert route_template({}, 401) == UNROUTED
