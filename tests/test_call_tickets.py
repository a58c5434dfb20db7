"""The run-ticket protocol (state/calls.py, state/records.py) against a real Redis: a
call runs at most once, its result outlives its waiter, a call that never ran may be sent
again under the same sequence number."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from orchestrator.config import Settings
from orchestrator.state.calls import (
    DUPLICATE_DELIVERY,
    CallStartStatus,
    Dispatch,
    DispatchOutcome,
    TicketState,
    WorkerCalls,
)
from orchestrator.state.connection import call_path_connection
from orchestrator.state.forget import forget_deployment
from orchestrator.state.keys import Keys
from orchestrator.state.records import RolloutStore
from orchestrator.state.wire import WIRE_VERSION

pytestmark = pytest.mark.anyio


@pytest.fixture()
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture()
def keys(settings: Settings) -> Iterator[Keys]:
    value = Keys.of(f"{settings.deployment}-tickets-{uuid.uuid4().hex[:8]}")
    yield value
    forget_deployment(settings.redis_url, value.deployment)


@pytest.fixture()
async def store(keys: Keys) -> AsyncIterator[RolloutStore]:
    store = RolloutStore(Settings().redis_url, keys)
    # Calls start only in an active rollout (the record's other fields play no part here).
    await store.redis.hset(keys.rollout("r1"), mapping={"state": "active"})
    yield store
    await store.close()


@pytest.fixture()
def workers(keys: Keys) -> Iterator[WorkerCalls]:
    connection = call_path_connection(Settings().redis_url, keys.client_name("worker"))
    yield WorkerCalls(connection)
    connection.close()


async def _begin(store: RolloutStore, call_id: str = "c1") -> tuple[str, int, str]:
    start = await store.calls.begin("r1", call_id, lock_ttl_s=30, reply_to=store.keys.reply("r1"))
    return start.status, start.seq, start.token


async def test_a_claimed_call_cannot_be_cancelled(
    store: RolloutStore, workers: WorkerCalls, keys: Keys
) -> None:
    status, seq, attempt = await _begin(store)
    assert (status, seq) == ("run", 1)
    key = keys.ticket("r1", "c1")
    assert workers.claim(key, attempt, "w1", time.time(), "d1") == "running"
    assert await store.calls.cancel("r1", "c1", attempt) == TicketState.RUNNING
    ticket = await store.calls.read("r1", "c1")
    assert ticket.worker == "w1"


async def test_a_message_delivered_twice_runs_once(
    store: RolloutStore, workers: WorkerCalls, keys: Keys
) -> None:
    """A second delivery of the same message, to this worker or another, is skipped; the
    first delivery's claim, sent again after a dropped connection, still finds itself."""
    _, _, attempt = await _begin(store)
    key = keys.ticket("r1", "c1")
    assert workers.claim(key, attempt, "w1", time.time(), "d1") == "running"
    assert workers.claim(key, attempt, "w1", time.time(), "d2") == DUPLICATE_DELIVERY
    assert workers.claim(key, attempt, "w2", time.time(), "d3") == DUPLICATE_DELIVERY
    assert workers.claim(key, attempt, "w1", time.time(), "d1") == "running"
    assert (await store.calls.read("r1", "c1")).worker == "w1"


async def test_a_cancelled_call_is_never_claimed_and_keeps_its_seq(
    store: RolloutStore, workers: WorkerCalls, keys: Keys
) -> None:
    _, seq, attempt = await _begin(store)
    key = keys.ticket("r1", "c1")
    assert await store.calls.cancel("r1", "c1", attempt) == TicketState.CANCELLED
    assert workers.claim(key, attempt, "w1", time.time(), "d1") == "cancelled"
    await store.calls.end("r1", "c1", attempt, reply=None, step=None)
    status, again, new_attempt = await _begin(store)
    assert (status, again) == ("run", seq), "the retry takes the place of the call never run"
    assert new_attempt != attempt
    # The first attempt's message, if it is still queued, is skipped: superseded.
    assert workers.claim(key, attempt, "w1", time.time(), "d2") == "superseded"
    assert workers.claim(key, new_attempt, "w1", time.time(), "d3") == "running"


async def test_claim_and_cancel_race_has_exactly_one_winner(
    store: RolloutStore, workers: WorkerCalls, keys: Keys
) -> None:
    for i in range(30):
        call_id = f"race{i}"
        _, _, attempt = await _begin(store, call_id)
        key = keys.ticket("r1", call_id)
        claims: list[str] = []
        worker = threading.Thread(
            target=lambda k=key, a=attempt, out=claims: out.append(
                workers.claim(k, a, "w", time.time(), "d")
            )
        )
        worker.start()
        cancelled = await store.calls.cancel("r1", call_id, attempt)
        worker.join()
        assert (claims[0] == "running") != (cancelled == TicketState.CANCELLED), (claims, cancelled)


async def test_the_result_outlives_its_waiter_and_a_retry_settles_it_once(
    store: RolloutStore, workers: WorkerCalls, keys: Keys
) -> None:
    _, seq, attempt = await _begin(store)
    key = keys.ticket("r1", "c1")
    workers.claim(key, attempt, "w1", time.time(), "d1")
    result = json.dumps({"result": None})
    state, reply_to = workers.finish(key, "w1", result, time.time())
    assert (state, reply_to) == ("done", keys.reply("r1"))
    # The result is on the ticket and in the reply list, from the same step.
    assert await store.redis.lrange(keys.reply("r1"), 0, -1) == [result]
    # The waiter died holding the lock: a retry sees the call busy and its ticket done.
    retry = await store.calls.begin("r1", "c1", lock_ttl_s=30, reply_to="other")
    assert (retry.status, retry.ticket) == ("busy", "done")
    first = await store.calls.end("r1", "c1", "", reply={"output": "a"}, step=None)
    second = await store.calls.end("r1", "c1", attempt, reply={"output": "b"}, step=None)
    assert first is None, "its own reply was stored: nothing comes back"
    assert second == {"output": "a"}, "the first stored reply wins"
    assert await store.calls.stored_reply("r1", "c1") == {"output": "a"}
    record = await store.redis.hget(store.keys.rollout("r1"), "calls_in_flight")
    assert int(record or 0) == 0, "counted out of flight once"
    assert (await _begin(store))[0] == "stored"
    assert seq == 1


async def test_a_result_after_the_call_was_declared_lost_is_evidence_only(
    store: RolloutStore, workers: WorkerCalls, keys: Keys
) -> None:
    _, _, attempt = await _begin(store)
    key = keys.ticket("r1", "c1")
    workers.claim(key, attempt, "w1", time.time(), "d1")
    assert await store.calls.mark_lost("r1", "c1", "w1") == TicketState.LOST
    state, reply_to = workers.finish(key, "w1", json.dumps({"late": True}), time.time())
    assert (state, reply_to) == ("lost", "")
    assert await store.redis.llen(keys.reply("r1")) == 0, "nobody is told a late result"
    ticket = await store.calls.read("r1", "c1")
    assert ticket.result == ""
    retry = await store.calls.begin("r1", "c1", lock_ttl_s=30, reply_to="other")
    assert (retry.status, retry.ticket) == ("busy", "lost")
    await store.calls.end("r1", "c1", attempt, reply=None, step=None)
    assert (await _begin(store))[0] == "lost"


async def test_concurrent_first_attempts_run_one(store: RolloutStore) -> None:
    starts = await asyncio.gather(
        *(store.calls.begin("r1", "c1", lock_ttl_s=30, reply_to=f"l{i}") for i in range(10))
    )
    assert [s.status for s in starts].count(CallStartStatus.RUN) == 1


async def test_a_call_for_a_sandbox_the_rollout_no_longer_has_changes_nothing(
    store: RolloutStore, keys: Keys
) -> None:
    """A rollout paused and resumed has another sandbox: a process that knew the old one
    hears MOVED, and nothing (lock, ticket, flight count) is taken."""
    await store.redis.hset(keys.rollout("r1"), "sandbox", json.dumps({"sandbox_id": "sbx-new"}))
    moved = await store.calls.begin(
        "r1", "c1", lock_ttl_s=30, reply_to=keys.reply("r1"), sandbox_id="sbx-old"
    )
    assert moved.status == CallStartStatus.MOVED
    assert await store.redis.hget(keys.rollout("r1"), "calls_in_flight") is None
    assert not await store.redis.exists(keys.call_lock("r1", "c1"))
    start = await store.calls.begin(
        "r1", "c1", lock_ttl_s=30, reply_to=keys.reply("r1"), sandbox_id="sbx-new"
    )
    assert start.status == CallStartStatus.RUN and start.seq == 1


@pytest.mark.parametrize(
    ("beat", "sent"),
    [
        ({"draining": False}, False),  # a worker of a release before the wire was in beats
        ({"draining": False, "wire": WIRE_VERSION - 1}, False),
        ({"draining": False, "wire": WIRE_VERSION}, True),
        ({"draining": True, "wire": WIRE_VERSION}, False),
    ],
)
async def test_a_call_is_sent_only_to_a_worker_that_speaks_its_wire(
    store: RolloutStore, keys: Keys, beat: dict[str, object], sent: bool
) -> None:
    """An upgrade mixes releases: a worker that could not run this release's message is
    never sent it, and the call is a never-run (its ticket queued, for the caller to
    cancel and answer 503), not a message no handler takes."""
    await store.redis.set(keys.heartbeat("h1"), json.dumps(beat))
    dispatch = Dispatch(
        heartbeat_key=keys.heartbeat("h1"),
        queue=keys.host_queue("h1"),
        message="the-message",
        wire=WIRE_VERSION,
    )
    start = await store.calls.begin(
        "r1", "c1", lock_ttl_s=30, reply_to=keys.reply("r1"), dispatch=dispatch
    )
    assert start.status == CallStartStatus.RUN
    queued = [
        m.decode() if isinstance(m, bytes) else m
        for m in await store.redis.lrange(keys.host_queue("h1"), 0, -1)
    ]
    if sent:
        assert start.dispatch == DispatchOutcome.SENT and queued == ["the-message"]
    else:
        assert start.dispatch == DispatchOutcome.NO_WORKER and queued == []
        assert json.loads(start.heartbeat) == beat
    await store.redis.delete(keys.host_queue("h1"))


async def test_a_worker_refuses_an_earlier_release_call_unrun(
    store: RolloutStore, workers: WorkerCalls, keys: Keys
) -> None:
    """A worker given a message it cannot run (an earlier API's) cancels its ticket: that
    API's wait reads it as never run; a call claimed or superseded meanwhile is left be."""
    _, _, attempt = await _begin(store)
    key = keys.ticket("r1", "c1")
    assert workers.refuse(key, "another-attempt") == TicketState.QUEUED
    assert workers.refuse(key, attempt) == TicketState.CANCELLED
    assert workers.claim(key, attempt, "w1", time.time(), "d1") == "cancelled"
    await store.calls.end("r1", "c1", attempt, reply=None, step=None)
    _, _, running = await _begin(store, "c2")
    key2 = keys.ticket("r1", "c2")
    assert workers.claim(key2, running, "w1", time.time(), "d2") == "running"
    assert workers.refuse(key2, running) == TicketState.RUNNING
