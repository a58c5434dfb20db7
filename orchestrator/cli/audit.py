"""``orchestrator audit``: the deployment's audit log, what changed it, who and when
(state/audit.py, docs/tenancy.md); and the one way a CLI command records its change."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from rich.table import Table

from orchestrator.cli.times import when
from orchestrator.config import Settings, get_settings
from orchestrator.observability.logging import local_actor
from orchestrator.state.audit import AuditEntry, AuditEvent, AuditLog
from orchestrator.state.errors import StateError
from orchestrator.state.records import RolloutStore
from orchestrator.views.format import console


def record(settings: Settings, event: AuditEvent, **details: Any) -> None:
    """Record a CLI command's change, its actor the user running it at this host. Redis
    out of reach (a build host with no way to it) does not fail the command: the entry
    is still said on stderr, and the failure with it."""

    async def main() -> None:
        store = RolloutStore.connect(settings, role="cli")
        try:
            entry = AuditEntry(event=event, actor=local_actor(), details=details)
            await AuditLog(store.redis, store.keys).record(entry)
        finally:
            await store.close()

    try:
        asyncio.run(main())
    except (StateError, OSError) as exc:
        typer.echo(f"warning: the audit log could not record {event.value}: {exc}", err=True)


def audit(
    since: Annotated[
        str | None,
        typer.Option(help="Only entries at or after: an ISO 8601 time, Unix seconds, or an age."),
    ] = None,
    event: Annotated[AuditEvent | None, typer.Option(help="Only entries of this event.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="At most this many, the newest.")] = 200,
    json_: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """What changed the deployment, who and when, oldest first: tenants' credentials and
    quotas, environments, codebases, repositories, an admin's end of another tenant's
    rollout."""
    settings = get_settings()
    start = when(since, "--since")

    async def main() -> list[AuditEntry]:
        store = RolloutStore.connect(settings, role="cli")
        try:
            return await AuditLog(store.redis, store.keys).read(since=start, limit=limit)
        finally:
            await store.close()

    entries = [e for e in asyncio.run(main()) if event is None or e.event == event]
    if json_:
        typer.echo(json.dumps([e.model_dump(mode="json") for e in entries], indent=2))
        return
    table = Table(title=f"audit log ({len(entries)})", title_justify="left")
    for column in ("when", "event", "actor", "details"):
        table.add_column(column, overflow="fold")
    for entry in entries:
        at = datetime.fromtimestamp(entry.at, UTC).strftime("%Y-%m-%d %H:%M:%S")
        details = " ".join(f"{k}={v}" for k, v in entry.details.items())
        table.add_row(at, entry.event.value, entry.actor, details)
    console().print(table)
