"""``orchestrator status``: the deployment at a glance, live in the terminal.

Hosts and their health, sandboxes by state, warm pools, queue depth, admission, tool-call
rate and latency, the infra-error ratio, and the recent infrastructure failures with their
evidence. State comes from Redis (views/state.py: the read model of state/snapshot.py,
which the API's state gauges show too); rates from two scrapes of the API's /metrics
``--interval`` seconds apart (views/scrape.py).
"""

from __future__ import annotations

import asyncio
import datetime
import time
from typing import Annotated

import httpx
import typer
from rich.console import Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from orchestrator.cli.serve import operator_token
from orchestrator.config import Settings, get_settings
from orchestrator.environments.loader import EnvironmentRegistry, load_environments
from orchestrator.state.records import RolloutStore
from orchestrator.state.snapshot import StateReader
from orchestrator.tenants import DEFAULT_TENANT
from orchestrator.views.format import age, console, ms, size
from orchestrator.views.models import CallStats, HostView, StatusSnapshot
from orchestrator.views.scrape import Scrape, call_stats, fetch
from orchestrator.views.state import read_state

FAILURES_SHOWN = 10


def default_api_url(settings: Settings) -> str:
    """The API this deployment serves (its own host and port)."""
    return f"http://{settings.api_host}:{settings.api_port}"


def default_metrics_url(settings: Settings) -> str:
    """Where this deployment's API metrics are read: the scraper's own port when it has
    one (no token wanted), else the API's (with the operator's token)."""
    if settings.api_metrics_port:
        return f"http://{settings.api_metrics_host}:{settings.api_metrics_port}"
    return default_api_url(settings)


async def _read(settings: Settings, registry: EnvironmentRegistry) -> StatusSnapshot:
    store = RolloutStore.connect(settings, role="cli")
    reader = StateReader(settings, registry, role="cli")
    try:
        return await read_state(reader, store)
    finally:
        reader.close()
        await store.close()


def _scrape(api_url: str, token: str | None) -> tuple[Scrape | None, str | None]:
    try:
        return fetch(api_url, token=token), None
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"


def take_snapshot(
    settings: Settings,
    registry: EnvironmentRegistry,
    api_url: str,
    before: Scrape | None,
    token: str | None = None,
) -> tuple[StatusSnapshot, Scrape | None]:
    """One frame: Redis state, and the calls since ``before`` (the previous scrape, with
    the operator's ``token`` when there is one: the scraper's port ignores it)."""
    snapshot = asyncio.run(_read(settings, registry))
    after, error = _scrape(api_url, token)
    if after is None:
        snapshot.calls = CallStats(api_url=api_url, error=error)
    else:
        snapshot.calls = call_stats(api_url, before, after)
    return snapshot, after


def render(snapshot: StatusSnapshot) -> RenderableType:
    """The status view of one snapshot."""
    when = datetime.datetime.fromtimestamp(snapshot.taken_at).strftime("%H:%M:%S")
    title = Text.assemble(
        ("orchestrator status", "bold"),
        f"  deployment {snapshot.deployment}  at {when}  ",
        ("redis ok", "green")
        if snapshot.redis_ok
        else (f"REDIS DOWN: {snapshot.redis_error}", "bold red"),
    )
    parts: list[RenderableType] = [title]
    if snapshot.redis_ok:
        parts += [_hosts(snapshot), _sandboxes(snapshot), _queues(snapshot)]
    parts.append(_calls(snapshot.calls))
    if snapshot.redis_ok:
        parts.append(_failures(snapshot))
    return Group(*parts)


def _yes(value: bool, no: str = "no") -> Text:
    return Text("yes", style="green") if value else Text(no, style="bold red")


def _hosts(snapshot: StatusSnapshot) -> Table:
    table = Table(title="hosts", title_justify="left", expand=False)
    for column in ("host", "up", "daemon", "schedulable", "slots", "sandboxes", "rollouts"):
        table.add_column(column, overflow="fold")
    for column in ("calls now", "disk free", "mem avail", "daemons' CPU", "beat age"):
        table.add_column(column)
    for host in snapshot.hosts:
        cordon = "yes" if host.schedulable else "; ".join(host.cordon_reasons) or "no"
        daemon = "ok" if host.healthy else (host.error or f"{host.backend_failures} failed probes")
        if not host.alive:
            daemon = "-"  # no heartbeat: nothing known of its daemon
        capacity = "-" if host.capacity is None else str(host.capacity)
        table.add_row(
            host.host,
            _yes(host.alive, "DOWN"),
            Text(daemon, style="green" if host.healthy else "bold red"),
            Text(cordon, style="green" if host.schedulable else "yellow"),
            f"{host.slots_used}/{capacity}",
            "-" if host.sandboxes is None else str(host.sandboxes),
            str(host.live_rollouts),
            str(host.running_calls),
            size(host.disk_free_bytes),
            size(host.mem_available_bytes),
            _daemon_cpu(host),
            age(host.heartbeat_age_s),
        )
    if not snapshot.hosts:
        table.add_row("(no worker host has ever sent a heartbeat)", *[""] * 11)
    return table


def _daemon_cpu(host: HostView) -> Text:
    """The sandbox daemons' CPU weight (sandbox/daemon_share.py), or why it is not set."""
    share = host.daemon_cpu
    if share is None:
        return Text("as is")
    if share.enforced:
        return Text(f"weight {share.weight}", style="green")
    return Text(f"not set: {share.detail}", style="yellow")


def _sandboxes(snapshot: StatusSnapshot) -> RenderableType:
    counts = snapshot.sandboxes
    states = ", ".join(f"{k} {v}" for k, v in sorted(counts.rollouts_by_state.items())) or "none"
    line = Text(
        f"sandboxes: live rollouts {snapshot.live_rollouts} ({states}); "
        f"warm ready {counts.pool_ready}, warm being made {counts.pool_creating}"
    )
    if not snapshot.pools:
        return line
    table = Table(title="warm pools", title_justify="left")
    for column in ("pool", "ready", "target", "being made"):
        table.add_column(column, overflow="fold")
    for pool in snapshot.pools:
        target = "(not configured)" if pool.target is None else str(pool.target)
        low = pool.target is not None and pool.ready < pool.target
        table.add_row(
            pool.pool,
            Text(str(pool.ready), style="yellow" if low else ""),
            target,
            str(pool.creating),
        )
    return Group(line, table)


def _queues(snapshot: StatusSnapshot) -> RenderableType:
    admission = snapshot.admission
    line = Text("admission: -")
    if admission is not None:
        line = Text(
            f"admission: slots {admission.slots_used}/{admission.slots_total} used, "
            f"{admission.waiting} rollouts waiting for one",
            style="yellow" if admission.waiting else "",
        )
        if len(admission.tenants) > 1 or set(admission.tenants) - {DEFAULT_TENANT}:
            held = ", ".join(f"{t} {n}" for t, n in admission.tenants.items())
            line.append(f"\nsandboxes by tenant: {held}")
    table = Table(title="queues", title_justify="left")
    table.add_column("queue", overflow="fold")
    table.add_column("waiting messages")
    for queue in snapshot.queues:
        table.add_row(queue.queue, str(queue.depth))
    return Group(line, table)


def _calls(calls: CallStats | None) -> RenderableType:
    if calls is None:
        return Text("tool calls: -")
    if calls.error is not None:
        return Text(f"tool calls: {calls.api_url}/metrics unreadable: {calls.error}", style="red")
    outcomes = ", ".join(f"{k} {v:g}" for k, v in sorted(calls.by_outcome.items())) or "none"
    ratio = "-" if calls.infra_error_ratio is None else f"{calls.infra_error_ratio:.1%}"
    window = f"last {calls.window_s:.1f}s" if calls.window_s else "since the API started"
    line = Text(
        f"tool calls ({window}): {calls.calls:g} ({calls.rate_per_s:.2f}/s): {outcomes}; "
        f"infra-error ratio {ratio}; {calls.calls_since_start:g} since the API started"
    )
    table = Table(title="tool-call latency", title_justify="left")
    for column in ("phase", "calls", "p50", "p99"):
        table.add_column(column)
    for phase in calls.latency:
        table.add_row(phase.phase, str(phase.count), ms(phase.p50_ms), ms(phase.p99_ms))
    parts: list[RenderableType] = [line, table]
    if calls.infra_errors_by_cause:
        causes = ", ".join(f"{k} {v:g}" for k, v in sorted(calls.infra_errors_by_cause.items()))
        parts.append(Text(f"infra errors by cause ({window}): {causes}", style="red"))
    return Group(*parts)


def _failures(snapshot: StatusSnapshot) -> RenderableType:
    failures = snapshot.recent_failures[:FAILURES_SHOWN]
    if not failures:
        return Text("recent infra failures: none", style="green")
    table = Table(
        title=f"recent infra failures (newest {len(failures)} of {len(snapshot.recent_failures)})",
        title_justify="left",
    )
    for column in ("age", "trace / rollout", "host", "cause", "message", "evidence"):
        table.add_column(column, overflow="fold")
    for failure in failures:
        table.add_row(
            age(snapshot.taken_at - failure.at),
            failure.trace_id or failure.rollout_id,
            failure.host or "-",
            Text(failure.cause, style="red"),
            failure.message,
            failure.evidence,
        )
    return table


def status(
    interval: Annotated[
        float, typer.Option(min=0.2, help="Seconds between refreshes (and the rate window).")
    ] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
    json_: Annotated[
        bool, typer.Option("--json", help="Print one snapshot as JSON and exit.")
    ] = False,
    api_url: Annotated[
        str, typer.Option(help="The API whose /metrics give rates; default: this deployment's.")
    ] = "",
) -> None:
    """Hosts, sandboxes, queues, tool-call rate and latency, and recent infra failures,
    refreshed every --interval seconds (Ctrl-C exits)."""
    settings = get_settings()
    url = api_url or default_metrics_url(settings)
    token = operator_token(settings)
    registry = load_environments(settings)
    out = console()
    if once or json_:
        # Rates need a window: two scrapes --interval apart.
        _, before = take_snapshot(settings, registry, url, None, token)
        time.sleep(interval)
        snapshot, _ = take_snapshot(settings, registry, url, before, token)
        if json_:
            typer.echo(snapshot.model_dump_json(indent=2))
        else:
            out.print(render(snapshot))
        return
    snapshot, before = take_snapshot(settings, registry, url, None, token)
    try:
        with Live(render(snapshot), console=out, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                snapshot, after = take_snapshot(settings, registry, url, before, token)
                before = after or before
                live.update(render(snapshot), refresh=True)
    except KeyboardInterrupt:
        return
