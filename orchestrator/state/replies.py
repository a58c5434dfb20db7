"""Tasks and their replies: the API asks a host's worker through :class:`WorkerClient`,
typed by the task's request and reply (state/wire.Tasks), and awaits the reply without
blocking the event loop; the worker pushes it.

Replies do not go through Celery's result backend: each task pushes its reply to a Redis
list named in the payload (``reply_to``), and the API waits on it with BLPOP on its async
Redis client. A wait is bounded, and while it lasts the host's heartbeat is checked, so a
call whose worker is gone fails fast as an infrastructure error instead of hanging. A wait
outlives Redis going away and coming back within its bound (a restart keeps the reply list,
and the worker pushes its reply once Redis is back): a sandbox's creation awaited in the
background must not be dropped half-way, leaving its rollout "creating" for good.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import redis
import redis.asyncio as aioredis
from celery import Celery
from pydantic import BaseModel

from orchestrator.config import Settings
from orchestrator.state.broker import task_message
from orchestrator.state.calls import REPLY_LIST_TTL_S
from orchestrator.state.errors import StateError
from orchestrator.state.heartbeat import Heartbeats
from orchestrator.state.keys import Keys, queue_depth_keys
from orchestrator.state.records import RolloutStore
from orchestrator.state.wire import ReplyT, Request, RequestT, Task

HEARTBEAT_CHECK_S = 1.0
STATE_RETRY_S = 0.2
"""How long a reply's wait pauses when Redis cannot be reached, before it asks again."""


class QueueTimeout(Exception):
    """No reply within the bound, or the host's worker vanished while we waited."""


class WorkerClient:
    """The API's side of the queue: a task sent to the host that holds a sandbox (or, a
    shared task, to any host), its reply awaited."""

    def __init__(self, settings: Settings, app: Celery, store: RolloutStore) -> None:
        self.settings = settings
        self.app = app
        self.redis: aioredis.Redis = store.redis
        self._waits = store.waits
        self.keys = Keys.of(settings.deployment)
        self.heartbeats = Heartbeats(self.redis, self.keys)

    def reply_key(self) -> str:
        """A fresh list for one reply."""
        return self.keys.reply(uuid.uuid4().hex)

    async def call(
        self, task: Task[RequestT, ReplyT], request: RequestT, *, host: str | None, timeout_s: float
    ) -> ReplyT:
        """Run ``task`` on ``host``'s queue (None: a shared task, on the shared queue) and
        return its reply; :class:`QueueTimeout` when none comes within ``timeout_s`` or the
        host's worker stops beating."""
        if host is not None and not await self._alive(host):
            raise QueueTimeout(f"no live worker on host {host!r}")
        reply_key = self.reply_key()
        queue = self.queue_of(host)
        # Expiry makes a late worker drop the task instead of running a call whose caller
        # has already been told it failed.
        await self.send(
            task, request.model_copy(update={"reply_to": reply_key}), host=host, expires=timeout_s
        )
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise QueueTimeout(f"{task.name} got no reply within {timeout_s:.0f} s on {queue}")
            try:
                reply = await self.wait_reply(reply_key, min(remaining, HEARTBEAT_CHECK_S))
                if reply is not None:
                    return task.reply.model_validate(reply)
                alive = host is None or await self.heartbeats.alive(host)
            except StateError:
                # Redis is away (restarting, say): the task was sent, so its reply will be
                # pushed once Redis is back; ask again until the deadline.
                await asyncio.sleep(min(STATE_RETRY_S, max(0.0, deadline - time.monotonic())))
                continue
            if not alive:
                raise QueueTimeout(f"the worker on host {host!r} stopped while running {task.name}")

    def queue_of(self, host: str | None) -> str:
        """Where a task for ``host`` goes: its queue, or (None) the shared queue."""
        return self.keys.shared_queue if host is None else self.keys.host_queue(host)

    async def _alive(self, host_id: str) -> bool:
        """Whether the host's worker beats; True when Redis cannot tell now (the send that
        follows fails, or the wait rides the outage out)."""
        try:
            return await self.heartbeats.alive(host_id)
        except StateError:
            return True

    async def send(
        self,
        task: Task[RequestT, Any],
        request: RequestT,
        *,
        host: str | None,
        expires: float | None = None,
    ) -> None:
        """Publish without waiting for the task (teardown, or a reply awaited by
        :meth:`wait_reply`): Celery's message, pushed by the async client in one round trip
        (state/broker.task_message), so a burst of publishes never stalls the event loop
        nor waits for a thread."""
        message = self.message(task, request, host=host, expires=expires)
        await self.redis.lpush(self.queue_of(host), message)

    def message(
        self,
        task: Task[RequestT, Any],
        request: RequestT,
        *,
        host: str | None,
        expires: float | None,
    ) -> str:
        """The message :meth:`send` would push, for a script that pushes it itself
        (state/calls.ApiCalls.begin)."""
        return task_message(
            self.app,
            task.name,
            request.model_dump_json(),
            queue=self.queue_of(host),
            expires_s=expires,
        )

    async def depth(self, queue: str) -> int:
        """Messages waiting in ``queue`` (its priority sub-queues included)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in queue_depth_keys(queue):
                pipe.llen(key)
            sizes = await pipe.execute()
        return sum(int(size) for size in sizes)

    async def wait_reply(self, reply_key: str, timeout_s: float) -> dict[str, Any] | None:
        """One bounded wait on a reply list; None when nothing came."""
        # (0 would be forever: a wait is always bounded.)
        block_s = max(0.01, round(timeout_s, 3))
        popped = await self._waits.call("BLPOP", reply_key, block_s, block_s=block_s)
        if popped is None:
            return None
        reply: dict[str, Any] = json.loads(popped[1])
        return reply


def push_reply(client: redis.Redis, request: Request, reply: BaseModel) -> None:
    """The worker's side: push a task's reply to the list its caller waits on, if one
    does."""
    if not request.reply_to:
        return
    key = request.reply_to
    with client.pipeline(transaction=False) as pipe:
        pipe.rpush(key, reply.model_dump_json())
        pipe.expire(key, REPLY_LIST_TTL_S)
        pipe.execute()
