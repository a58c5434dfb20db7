"""The API's side of the queue: publish a task to a host's queue and await its reply
without blocking the event loop.

Replies do not go through Celery's result backend: each task pushes its reply to a Redis
list named in the payload, and the API waits on it with BLPOP on its async Redis client. A
wait is bounded, and while it lasts the host's heartbeat is checked, so a call whose
worker is gone fails fast as an infrastructure error instead of hanging.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import redis.asyncio as aioredis
from celery import Celery

from orchestrator.config import Settings

HEARTBEAT_CHECK_S = 1.0


class QueueTimeout(Exception):
    """No reply within the bound, or the host's worker vanished while we waited."""


class QueueClient:
    def __init__(self, settings: Settings, app: Celery, redis: aioredis.Redis) -> None:
        self.settings = settings
        self.app = app
        self.redis = redis

    def reply_key(self) -> str:
        """A fresh list for one reply."""
        return f"{self.settings.key_prefix}reply:{uuid.uuid4().hex}"

    async def worker_alive(self, host_id: str) -> bool:
        return bool(await self.redis.exists(self.settings.heartbeat_key(host_id)))

    async def heartbeat(self, host_id: str) -> dict[str, Any] | None:
        """The host's latest heartbeat (queue/worker.py), None when it has none."""
        raw = await self.redis.get(self.settings.heartbeat_key(host_id))
        return json.loads(raw) if raw else None

    async def live_hosts(self) -> list[dict[str, Any]]:
        hosts = await self.redis.smembers(self.settings.hosts_key)
        statuses = []
        for host in sorted(str(h) for h in hosts):
            raw = await self.redis.get(self.settings.heartbeat_key(host))
            if raw:
                statuses.append(json.loads(raw))
        return statuses

    async def call(
        self,
        task: str,
        payload: dict[str, Any],
        *,
        queue: str,
        timeout_s: float,
        host_id: str | None = None,
    ) -> dict[str, Any]:
        """Run ``task`` on ``queue`` and return its reply; :class:`QueueTimeout` when none
        comes within ``timeout_s`` or the worker of ``host_id`` stops beating."""
        if host_id is not None and not await self.worker_alive(host_id):
            raise QueueTimeout(f"no live worker on host {host_id!r}")
        reply_key = self.reply_key()
        payload = {**payload, "reply_to": reply_key}
        # Expiry makes a late worker drop the task instead of running a call whose caller
        # has already been told it failed.
        await self.send(task, payload, queue=queue, expires=timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise QueueTimeout(f"{task} got no reply within {timeout_s:.0f} s on {queue}")
            popped = await self.redis.blpop([reply_key], timeout=min(remaining, HEARTBEAT_CHECK_S))
            if popped is not None:
                reply: dict[str, Any] = json.loads(popped[1])
                return reply
            if host_id is not None and not await self.worker_alive(host_id):
                raise QueueTimeout(f"the worker on host {host_id!r} stopped while running {task}")

    async def send(
        self, task: str, payload: dict[str, Any], *, queue: str, expires: float | None = None
    ) -> None:
        """Publish without waiting for the task (teardown, or a call whose reply is awaited
        by :meth:`wait_reply`). Celery's publish is a blocking Redis write: it runs in a
        thread, so a burst of publishes never stalls the event loop."""
        await asyncio.to_thread(
            self.app.send_task,
            task,
            args=[payload],
            queue=queue,
            expires=expires,
            ignore_result=True,
        )

    async def wait_reply(self, reply_key: str, timeout_s: float) -> dict[str, Any] | None:
        """One bounded wait on a reply list; None when nothing came."""
        popped = await self.redis.blpop([reply_key], timeout=timeout_s)
        if popped is None:
            return None
        reply: dict[str, Any] = json.loads(popped[1])
        return reply
