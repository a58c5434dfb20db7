"""A reply's wait outlives a Redis restart (state/replies.WorkerClient.call), against a real
redis-server killed and started again on its port: the wait asks again until its deadline,
and takes the reply the worker pushes once Redis is back. Before, the wait raised on the
lost connection, and a sandbox's creation awaited in the background was dropped half-way:
its rollout stayed "creating" until the reaper called it stuck (seen once in a fresh-clone
run of tests/faults/test_faults.py::test_redis_restarted_mid_batch)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from orchestrator.config import Settings
from orchestrator.local import free_port
from orchestrator.state.broker import celery_app
from orchestrator.state.errors import StateError, outlasting_an_outage
from orchestrator.state.records import RolloutStore
from orchestrator.state.replies import QueueTimeout, WorkerClient
from orchestrator.state.wire import DropSnapshot, SnapshotDropped, Tasks
from tests.redis_ha import RedisServer

pytestmark = pytest.mark.anyio


@pytest.fixture()
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[RedisServer]:
    started = RedisServer(tmp_path, free_port())
    started.start()
    try:
        yield started
    finally:
        started.stop()


def _client(settings: Settings, server: RedisServer) -> tuple[WorkerClient, RolloutStore]:
    own = settings.model_copy(update={"redis_url": server.url})
    store = RolloutStore.connect(own)
    return WorkerClient(own, celery_app(), store), store


async def test_a_wait_outlives_a_redis_restart_and_takes_the_reply(
    settings: Settings, server: RedisServer
) -> None:
    queue, store = _client(settings, server)
    key = queue.reply_key()
    queue.reply_key = lambda: key  # type: ignore[method-assign]  # the list the test pushes to
    sync = redis.Redis.from_url(server.url)
    try:
        waiting = asyncio.ensure_future(
            queue.call(Tasks.DROP_SNAPSHOT, DropSnapshot(snapshot_id="s"), host=None, timeout_s=30)
        )
        # Until the task is sent (a blocking move of its message back where it was): the
        # wait has begun.
        shared = queue.keys.shared_queue
        assert await asyncio.to_thread(sync.blmove, shared, shared, 10, "RIGHT", "RIGHT")
        await asyncio.sleep(0.2)
        await asyncio.to_thread(server.kill)
        await asyncio.sleep(1.0)  # the wait meets a Redis that is not there
        assert not waiting.done()
        await asyncio.to_thread(server.start)
        await asyncio.to_thread(sync.rpush, key, json.dumps({"removed": True}))
        assert await asyncio.wait_for(waiting, 10) == SnapshotDropped(removed=True)
    finally:
        sync.close()
        await store.close()


async def test_a_wait_through_an_outage_still_ends_at_its_deadline(
    settings: Settings, server: RedisServer
) -> None:
    queue, store = _client(settings, server)
    try:
        waiting = asyncio.ensure_future(
            queue.call(Tasks.DROP_SNAPSHOT, DropSnapshot(snapshot_id="s"), host=None, timeout_s=2)
        )
        await asyncio.sleep(0.3)
        await asyncio.to_thread(server.kill)
        with pytest.raises(QueueTimeout):
            await asyncio.wait_for(waiting, 10)
    finally:
        await store.close()


async def test_a_write_outlasting_an_outage_lands_once_redis_is_back(
    settings: Settings, server: RedisServer
) -> None:
    """state/errors.outlasting_an_outage, as the start of a rollout records its sandbox."""
    _, store = _client(settings, server)
    try:
        await asyncio.to_thread(server.kill)
        writing = asyncio.ensure_future(
            outlasting_an_outage(lambda: store.redis.set("made", "yes"), for_s=30)
        )
        await asyncio.sleep(1.5)  # past the client's own retries (about 0.75 s)
        assert not writing.done()
        await asyncio.to_thread(server.start)
        assert await asyncio.wait_for(writing, 10)
        assert await store.redis.get("made") == "yes"
        await asyncio.to_thread(server.kill)
        with pytest.raises(StateError):
            await outlasting_an_outage(lambda: store.redis.get("made"), for_s=0.5)
    finally:
        await store.close()
