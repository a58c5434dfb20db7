"""The E2B API's per-sandbox process table (docs/e2b.md): the pid counter and the record
of each command started and not finished yet, so a client that reattaches to a pid, or
signals it, reaches the command whichever API process started it; and its directory
watchers, each with the tree as last seen, whichever API process a poll reaches."""

from __future__ import annotations

import json
import uuid
from typing import Any

import redis.asyncio as aioredis

from orchestrator.state.keys import Keys


class E2BProcesses:
    """Process records of E2B sandboxes (their rollouts), as JSON objects by pid."""

    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self._redis = client
        self._keys = keys

    async def next_pid(self, rollout_id: str) -> int:
        """A pid never given before in this sandbox."""
        return int(await self._redis.incr(self._keys.e2b_pid(rollout_id)))

    async def put(self, rollout_id: str, pid: int, record: dict[str, Any]) -> None:
        await self._redis.hset(self._keys.e2b_processes(rollout_id), str(pid), json.dumps(record))

    async def get(self, rollout_id: str, pid: int) -> dict[str, Any] | None:
        raw = await self._redis.hget(self._keys.e2b_processes(rollout_id), str(pid))
        if raw is None:
            return None
        found: dict[str, Any] = json.loads(raw)
        return found

    async def drop(self, rollout_id: str, pid: int) -> None:
        await self._redis.hdel(self._keys.e2b_processes(rollout_id), str(pid))

    async def running(self, rollout_id: str) -> list[dict[str, Any]]:
        raw = await self._redis.hgetall(self._keys.e2b_processes(rollout_id))
        return [json.loads(v) for v in raw.values()]


class E2BWatchers:
    """Directory watchers of E2B sandboxes (``files.watch_dir``), as JSON objects by id:
    the path, whether recursive, and the tree as last seen (name -> what it was)."""

    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self._redis = client
        self._keys = keys

    async def create(self, rollout_id: str, record: dict[str, Any]) -> str:
        watcher_id = uuid.uuid4().hex
        await self.put(rollout_id, watcher_id, record)
        return watcher_id

    async def put(self, rollout_id: str, watcher_id: str, record: dict[str, Any]) -> None:
        await self._redis.hset(self._keys.e2b_watchers(rollout_id), watcher_id, json.dumps(record))

    async def get(self, rollout_id: str, watcher_id: str) -> dict[str, Any] | None:
        raw = await self._redis.hget(self._keys.e2b_watchers(rollout_id), watcher_id)
        if raw is None:
            return None
        found: dict[str, Any] = json.loads(raw)
        return found

    async def remove(self, rollout_id: str, watcher_id: str) -> bool:
        return bool(await self._redis.hdel(self._keys.e2b_watchers(rollout_id), watcher_id))
