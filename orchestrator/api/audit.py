"""What the API process puts in the deployment's audit log (state/audit.py): the tenants
file's changes it notices, the environments it serves when they changed, and an admin's
end of another tenant's rollout (docs/tenancy.md, "Audit log")."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Coroutine
from typing import Any

from orchestrator.environments.loader import EnvironmentRegistry
from orchestrator.observability.logging import get_logger
from orchestrator.state.audit import AuditEntry, AuditEvent, AuditLog
from orchestrator.state.records import Rollout
from orchestrator.tenants import Change, Principal, Tenants

log = get_logger(__name__)


class AuditRecorder:
    """The API process's audit entries. A change of the tenants file is noticed inside a
    request's authentication: its entries are recorded in the background (the request
    never waits for them), once however many API processes notice it."""

    def __init__(self, audit_log: AuditLog, tenants: Tenants) -> None:
        self.log = audit_log
        self.tenants = tenants
        self._pending: set[asyncio.Task[Any]] = set()
        tenants.on_change = self._tenants_changed

    def _tenants_changed(self, found: list[Change]) -> None:
        reading = self.tenants.directory.mtime_ns
        for event, details in found:
            entry = AuditEntry(event=AuditEvent(event), actor="tenants-file", details=details)
            once = f"{event}:{json.dumps(details, sort_keys=True)}:{reading}"
            self._spawn(self.log.record(entry, once=once))

    async def environments(self, environments: EnvironmentRegistry) -> None:
        """Record the environments this process serves, when they are not the ones the
        deployment served before (a changed environments file, rolled out)."""
        digests = {name: environments.get(name).digest for name in environments.names()}
        overall = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()
        entry = AuditEntry(
            event=AuditEvent.ENVIRONMENTS_CHANGED, actor="api", details={"digests": digests}
        )
        await self.log.record_if_changed("environments", overall, entry)

    async def rollout_ended(self, caller: Principal, rollout: Rollout, via: str) -> None:
        """An admin ended another tenant's rollout (a tenant ending its own is routine)."""
        if caller.tenant == rollout.tenant:
            return
        details = {"rollout_id": rollout.rollout_id, "tenant": rollout.tenant, "via": via}
        await self.log.record(
            AuditEntry(event=AuditEvent.ROLLOUT_ENDED, actor=caller.tenant, details=details)
        )

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("audit.not_recorded", error=repr(task.exception()))

    async def close(self) -> None:
        """Wait for the entries still being recorded."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
