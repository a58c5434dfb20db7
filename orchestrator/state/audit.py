"""The audit log: what changed the deployment, who did it and when (docs/tenancy.md,
"Audit log").

Kept in Redis (a stream, capped at :data:`AUDIT_KEEP` entries), so a change made from an
operator's laptop (a codebase, a repository) and one an API process noticed (a token
revoked in the tenants file) are read in one place: ``orchestrator audit``. Every entry is
also a log line (``audit.<event>``, logger ``orchestrator.audit``) for the deployment's
log shipping. Never a credential: a digest's first digits name one.
"""

from __future__ import annotations

import hashlib
import json
import time
from enum import StrEnum
from typing import Any, cast

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from orchestrator.observability.logging import audit as audit_line
from orchestrator.state.keys import Keys

AUDIT_KEEP = 100_000
"""Entries kept: older ones are trimmed (approximately, as XADD's MAXLEN ~ does)."""
ONCE_S = 24 * 3600
"""How long a change every API process sees is remembered as recorded."""


class AuditEvent(StrEnum):
    """What changed."""

    CREDENTIAL_ADDED = "credential_added"
    CREDENTIAL_REVOKED = "credential_revoked"
    TENANT_ADDED = "tenant_added"
    TENANT_REMOVED = "tenant_removed"
    QUOTAS_CHANGED = "quotas_changed"
    ENVIRONMENTS_CHANGED = "environments_changed"
    CODEBASE_ADDED = "codebase_added"
    CODEBASE_REMOVED = "codebase_removed"
    CODEBASE_PUBLISHED = "codebase_published"
    REPOSITORY_ADDED = "repository_added"
    REPOSITORY_REMOVED = "repository_removed"
    ROLLOUT_ENDED = "rollout_ended"
    """Another tenant's rollout (or E2B sandbox) ended by an admin: a forced end."""


class AuditEntry(BaseModel):
    """One entry of the audit log."""

    event: AuditEvent
    actor: str = Field(
        description="Who: a tenant (through the API), user@host (the CLI), or the file or "
        "process that changed (tenants-file, api)."
    )
    at: float = Field(default_factory=time.time)
    details: dict[str, Any] = Field(default_factory=dict)
    id: str = Field("", description="The stream's id of the entry (when read).")


class AuditLog:
    """Record and read the deployment's audit log."""

    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys

    async def record(self, entry: AuditEntry, *, once: str = "") -> bool:
        """Add ``entry`` (and say it in the log). ``once``: a name for a change that every
        API process sees by itself; only the first to record it does. False: another had."""
        if once:
            digest = hashlib.sha256(once.encode()).hexdigest()[:32]
            first = await self.redis.set(self.keys.audit_once(digest), "1", nx=True, ex=ONCE_S)
            if not first:
                return False
        audit_line(entry.event.value, actor=entry.actor, **entry.details)
        await self.redis.xadd(
            self.keys.audit,
            {"entry": entry.model_dump_json(exclude={"id"})},
            maxlen=AUDIT_KEEP,
            approximate=True,
        )
        return True

    async def record_if_changed(self, name: str, digest: str, entry: AuditEntry) -> bool:
        """Record ``entry`` only when ``digest`` differs from the last one recorded under
        ``name`` (what every API process says at its start: recorded once per change)."""
        previous = await self.redis.set(self.keys.audit_once(f"last:{name}"), digest, get=True)
        if previous == digest:
            return False
        return await self.record(entry)

    async def read(self, *, since: float | None = None, limit: int = 1000) -> list[AuditEntry]:
        """The newest ``limit`` entries since ``since`` (a Unix time; None: any), oldest
        first."""
        start = f"{int(since * 1000)}-0" if since is not None else "-"
        raw = await self.redis.xrevrange(self.keys.audit, max="+", min=start, count=limit)
        entries = []
        for entry_id, fields in reversed(cast(list[tuple[str, dict[str, str]]], raw or [])):
            body = json.loads(fields["entry"])
            entries.append(AuditEntry.model_validate({**body, "id": str(entry_id)}))
        return entries
