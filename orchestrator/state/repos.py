"""Registered repositories (docs/datasets.md): a row names one by its name and a commit,
and every host fetches it from the source registered here (sandbox/repos.py). Also the
commits found to exist, with their set-up images, so a burst of rows on one commit asks a
host about it once."""

from __future__ import annotations

import time

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.sandbox.backend import CommitWorkspace, RepoSetup
from orchestrator.state.keys import Keys


class RepoRecord(BaseModel):
    """A registered repository."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")
    source: str = Field(min_length=1, description="A local path or an allowed URL.")
    added_at: float = Field(default_factory=time.time)
    commits: int = Field(0, description="Commits its source had when it was added.")
    head: str = Field("", description="The commit its source's HEAD was when it was added.")
    setup: RepoSetup | None = Field(None, description="How its dependencies are installed.")

    def at(self, commit: str, setup_image: str = "") -> CommitWorkspace:
        """This repository at ``commit`` (on ``setup_image``, its set-up's image for the
        commit), as a sandbox's spec names it."""
        return CommitWorkspace(
            repo=self.name,
            commit=commit,
            source=self.source,
            setup=self.setup,
            setup_image=setup_image,
        )


class RepoRegistry:
    """The deployment's registered repositories and their known commits."""

    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self._redis = client
        self._keys = keys

    async def add(self, record: RepoRecord, *, replace: bool = False) -> bool:
        """Register ``record``; False when the name is taken and ``replace`` is not set.
        A replaced repository's known commits are forgotten (its source may differ)."""
        raw = record.model_dump_json()
        if not replace:
            return bool(await self._redis.hsetnx(self._keys.repos, record.name, raw))
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._keys.repos, record.name, raw)
            pipe.delete(self._keys.repo_commits(record.name))
            await pipe.execute()
        return True

    async def get(self, name: str) -> RepoRecord | None:
        raw = await self._redis.hget(self._keys.repos, name)
        return None if raw is None else RepoRecord.model_validate_json(raw)

    async def registered(self) -> list[RepoRecord]:
        """Every registered repository, by name."""
        raw = await self._redis.hgetall(self._keys.repos)
        records = [RepoRecord.model_validate_json(value) for value in raw.values()]
        return sorted(records, key=lambda r: r.name)

    async def remove(self, name: str) -> bool:
        """Forget ``name`` (rollouts running on it go on); False when it was not registered."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self._keys.repos, name)
            pipe.delete(self._keys.repo_commits(name))
            removed, _ = await pipe.execute()
        return bool(removed)

    async def known(self, name: str, commit: str) -> str | None:
        """The set-up image of ``commit`` of ``name`` ('' when the repository has no set-up)
        once a host has found the commit (:meth:`remember`); None before."""
        raw = await self._redis.hget(self._keys.repo_commits(name), commit)
        return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)

    async def remember(self, name: str, commits: dict[str, str]) -> None:
        """Note that ``commits`` exist in ``name``, each with its set-up image ('' none)."""
        if commits:
            async with self._redis.pipeline(transaction=False) as pipe:
                for commit, image in commits.items():
                    pipe.hset(self._keys.repo_commits(name), commit, image)
                await pipe.execute()
