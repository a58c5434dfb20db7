"""The deployment's snapshots (docs/snapshots.md): each kept on the host that took it
(sandbox/docker/snapshots.py), with what a sandbox made from it runs (its parent's pinned
environment, image and /workspace), so one can be made after the parent is gone."""

from __future__ import annotations

import time
import uuid
from enum import StrEnum

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from orchestrator.config import Runtime
from orchestrator.sandbox.backend import CommitWorkspace, SnapshotTaken
from orchestrator.state.connection import SyncRedis
from orchestrator.state.keys import Keys
from orchestrator.tenants import DEFAULT_TENANT, OPERATOR, Principal

FORK_RECORD_MAX_S = 3600.0
"""A fork's own snapshot is forgotten as soon as its sandboxes are made; one still recorded
this long after (its API process died mid-fork) is a leftover."""


def new_snapshot_id() -> str:
    """A fresh snapshot id (sandbox/docker/snapshots.SNAPSHOT_ID_RE)."""
    return "snap-" + uuid.uuid4().hex[:20]


class SnapshotKind(StrEnum):
    """Whose a snapshot is, which says how long it is kept."""

    NAMED = "named"
    """A client's (E2B ``create_snapshot``): listed, kept until deleted."""
    FORK = "fork"
    """A fork's own: forgotten once its sandboxes are made."""
    GROUP = "group"
    """A group's set-up (an environment's ``setup``): kept until ``keep_until``."""
    PAUSE = "pause"
    """A paused sandbox's: forgotten when it resumes, or at ``keep_until``."""


class GroupSetup(BaseModel):
    """A group's set-up, as its rollouts find it (``Keys.group_setup``): its snapshot, or
    why the set-up failed."""

    snapshot_id: str | None = None
    error: str | None = None


class SnapshotRecord(BaseModel):
    """A snapshot, and the sandbox it was taken of as its rollout was pinned."""

    snapshot_id: str
    name: str | None = Field(None, description="The client's name for it, if any.")
    host: str = Field(description="The host that keeps it: sandboxes from it are made there.")
    parent: str = Field(description="The rollout (E2B sandbox) it was taken of.")
    environment: str
    environment_digest: str | None = None
    environment_config: str | None = None
    image: str
    codebase: str | None = None
    workspace: CommitWorkspace | None = None
    runtime: Runtime
    template: str = Field("", description="The parent's E2B template, if it was one.")
    created_at: float = Field(default_factory=time.time)
    taken: SnapshotTaken
    kind: SnapshotKind = SnapshotKind.NAMED
    tenant: str = Field(DEFAULT_TENANT, description="Its parent's tenant: only it sees it.")
    keep_until: float | None = Field(
        None, description="A group's: forgotten after this (a Unix time)."
    )

    def expired(self, now: float) -> bool:
        """Past its time: a fork's left behind by a crash, or a group's past ``keep_until``."""
        if self.kind == SnapshotKind.FORK:
            return now - self.created_at > FORK_RECORD_MAX_S
        return self.keep_until is not None and now > self.keep_until


class SnapshotRegistry:
    """The deployment's snapshots, by id."""

    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self._redis = client
        self._keys = keys

    async def add(self, record: SnapshotRecord) -> None:
        await self._redis.hset(self._keys.snapshots, record.snapshot_id, record.model_dump_json())

    async def get(self, snapshot_id: str) -> SnapshotRecord | None:
        raw = await self._redis.hget(self._keys.snapshots, snapshot_id)
        return None if raw is None else SnapshotRecord.model_validate_json(raw)

    async def find(self, wanted: str, caller: Principal = OPERATOR) -> SnapshotRecord | None:
        """The snapshot whose id is ``wanted``, else the newest named ``wanted``, of those
        ``caller`` sees."""
        found = await self.get(wanted) if wanted.startswith("snap-") else None
        if found is not None and caller.sees(found.tenant):
            return found
        named = [r for r in await self.all() if r.name == wanted and caller.sees(r.tenant)]
        return max(named, key=lambda r: r.created_at) if named else None

    async def all(self) -> list[SnapshotRecord]:
        """Every client's snapshot (a fork's or a group's own not listed), oldest first."""
        raw = await self._redis.hvals(self._keys.snapshots)
        records = [SnapshotRecord.model_validate_json(r) for r in raw]
        named = (r for r in records if r.kind == SnapshotKind.NAMED)
        return sorted(named, key=lambda r: r.created_at)

    async def remove(self, snapshot_id: str) -> bool:
        """Forget a snapshot (its host removes its files); False when it was not here."""
        return bool(await self._redis.hdel(self._keys.snapshots, snapshot_id))


def kept_snapshots(client: SyncRedis, keys: Keys) -> set[str]:
    """The worker's side: the ids of every snapshot the deployment keeps, forgetting those
    past their time (its host's sweep removes the files of the others, once no sandbox is
    made over them)."""
    now = time.time()
    kept = set()
    for raw in client.hvals(keys.snapshots):
        record = SnapshotRecord.model_validate_json(raw)
        if record.expired(now):
            client.hdel(keys.snapshots, record.snapshot_id)
        else:
            kept.add(record.snapshot_id)
    return kept
