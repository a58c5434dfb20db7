"""``orchestrator rollouts ls|show``: the deployment's rollouts, and one rollout's
trajectory step by step (views/rollouts.py reads them from Redis)."""

from __future__ import annotations

import asyncio
import datetime
import json
from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

import typer
from pydantic import TypeAdapter
from rich.console import Group, RenderableType
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from orchestrator.cli.times import when
from orchestrator.config import get_settings
from orchestrator.outcomes import Outcome
from orchestrator.state.models import RolloutState, TrajectoryStep
from orchestrator.state.records import ListingCursor, RolloutStore
from orchestrator.views.format import age, arguments_text, console, head, ms
from orchestrator.views.models import RolloutDetail, RolloutSummary
from orchestrator.views.rollouts import cursor_of, list_rollouts, rollout_detail

app = typer.Typer(help="The deployment's rollouts.", no_args_is_help=True)

T = TypeVar("T")

OUTCOME_STYLES = {
    Outcome.OK: "green",
    Outcome.AGENT_ERROR: "yellow",
    Outcome.INFRA_ERROR: "bold red",
    Outcome.REJECTED: "magenta",
}


def _with_store(read: Callable[[RolloutStore], Awaitable[T]]) -> T:
    settings = get_settings()

    async def run() -> T:
        store = RolloutStore.connect(settings, role="cli")
        try:
            return await read(store)
        finally:
            await store.close()

    return asyncio.run(run())


def _outcome(outcome: Outcome | None) -> Text:
    if outcome is None:
        return Text("-")
    return Text(outcome.value, style=OUTCOME_STYLES.get(outcome, ""))


@app.command("ls")
def ls(
    state: Annotated[RolloutState | None, typer.Option(help="Only rollouts in this state.")] = None,
    outcome: Annotated[
        Outcome | None, typer.Option(help="Only rollouts with this outcome.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="At most this many, newest first.")] = 50,
    tenant: Annotated[
        str | None, typer.Option(help="Only this tenant's rollouts (docs/tenancy.md).")
    ] = None,
    before: Annotated[
        str | None,
        typer.Option(
            help="Only rollouts older than this: the cursor a full page prints "
            "(CREATED_AT/ROLLOUT_ID), or a time (ISO 8601, Unix seconds, or an age: 2h).",
        ),
    ] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The newest rollouts: trace id, rollout id, environment, state, outcome, calls,
    score, age. The whole history, a page at a time: a full page ends with the
    ``--before`` of the next (on stderr with ``--json``)."""
    cursor = _cursor(before)
    rollouts = _with_store(
        lambda store: list_rollouts(
            store,
            state=state.value if state else None,
            outcome=outcome.value if outcome else None,
            limit=limit,
            before=cursor,
            tenant=tenant,
        )
    )
    more = f"older: --before {cursor_of(rollouts[-1])}" if len(rollouts) == limit else ""
    if json_:
        adapter = TypeAdapter(list[RolloutSummary])
        typer.echo(adapter.dump_json(rollouts, indent=2).decode())
        if more:
            typer.echo(more, err=True)
        return
    table = Table(title=f"rollouts ({len(rollouts)}, newest first)", title_justify="left")
    for column in ("trace id", "rollout id", "environment", "state", "outcome"):
        table.add_column(column, overflow="fold")
    for column in ("calls", "score", "age"):
        table.add_column(column, justify="right")
    for r in rollouts:
        table.add_row(
            r.trace_id or "-",
            r.rollout_id,
            r.environment,
            r.state.value,
            _outcome(r.outcome),
            str(r.calls),
            "-" if r.score is None else f"{r.score:.3f}",
            age(r.age_s),
        )
    console().print(table)
    if more:
        typer.echo(more)


def _cursor(before: str | None) -> ListingCursor | None:
    if before is None:
        return None
    if "/" in before:
        try:
            return ListingCursor.parse(before)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--before") from None
    # A time: every rollout created before it (no id sorts below the empty one).
    return ListingCursor(created_at=when(before, "--before") or 0.0, rollout_id="")


@app.command("reindex")
def reindex() -> None:
    """Put every stored rollout in the listing index: for a deployment upgraded from a
    release whose index kept only the newest 10,000 (the records were all kept)."""
    count = _with_store(lambda store: store.reindex())
    typer.echo(f"indexed {count} rollouts")


@app.command("show")
def show(
    rollout: Annotated[str, typer.Argument(help="A trace id (Agent RFT) or a rollout id.")],
    lines: Annotated[int, typer.Option(min=1, help="Lines of each output to show.")] = 12,
    json_: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """One rollout: outcome, score, infra failure and its evidence, then the trajectory
    step by step (tool, arguments, outcome, duration, the head of the output)."""
    detail = _with_store(lambda store: rollout_detail(store, rollout))
    if detail is None:
        typer.echo(
            f"error: no rollout {rollout!r} in deployment {get_settings().deployment}", err=True
        )
        raise typer.Exit(1)
    if json_:
        typer.echo(detail.model_dump_json(indent=2))
        return
    out = console()
    out.print(_header(detail))
    if not detail.trajectory:
        out.print("(no tool call recorded)")
    for step in detail.trajectory:
        out.print(_step(step, lines))


def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(timestamp).isoformat(sep=" ", timespec="seconds")


def _header(detail: RolloutDetail) -> RenderableType:
    s = detail.summary
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    rows: list[tuple[str, str | Text]] = [
        ("trace id", s.trace_id or "-"),
        ("rollout id", s.rollout_id),
        ("source", s.source),
        ("environment", f"{s.environment}" + (f" (codebase {s.codebase})" if s.codebase else "")),
        ("state", s.state.value),
        ("outcome", _outcome(s.outcome)),
        ("score", "-" if s.score is None else f"{s.score:.4g}"),
        ("calls", f"{s.calls} made, {detail.calls_in_flight} in flight"),
        (
            "host / sandbox",
            f"{s.host or '-'} / {s.sandbox_id or '-'}" + (" (warm pool)" if s.pool_hit else ""),
        ),
        ("created", f"{_when(s.created_at)} ({age(s.age_s)} ago)"),
        ("graded", _when(detail.graded_at)),
        ("closed", _when(detail.closed_at)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    parts: list[RenderableType] = [table]
    if detail.grade_details:
        details = Table.grid(padding=(0, 2))
        details.add_column(style="bold")
        details.add_column(overflow="fold")
        for key, value in detail.grade_details.items():
            details.add_row(key, escape(json.dumps(value, default=str)))
        parts.append(Panel(details, title="grade details", title_align="left"))
    if detail.infra_failure:
        failure = detail.infra_failure
        body = Text.assemble(
            (f"{failure.get('cause', '?')}: ", "bold red"),
            str(failure.get("message", "")),
            "\nat " + _when(failure.get("at")),
            "\nevidence:\n" + json.dumps(failure.get("evidence") or {}, indent=2, default=str),
        )
        parts.append(
            Panel(body, title="infrastructure failure", title_align="left", border_style="red")
        )
    return Panel(Group(*parts), title=f"rollout {s.trace_id or s.rollout_id}", title_align="left")


def _step(step: TrajectoryStep, lines: int) -> RenderableType:
    timing = ms(step.duration_ms)
    if step.queue_ms is not None or step.exec_ms is not None:
        timing += f" (queue {ms(step.queue_ms)}, exec {ms(step.exec_ms)})"
    title = Text.assemble(
        (f"#{step.seq} {step.tool}", "bold"),
        "  ",
        _outcome(step.outcome),
        f"  exit {step.exit_code}" if step.exit_code is not None else "",
        f"  {step.error_kind}" if step.error_kind else "",
        f"  {timing}",
        "  truncated" if step.truncated else "",
    )
    output, more = head(step.output, lines)
    body = Text.assemble(
        ("arguments: ", "dim"),
        arguments_text(step.arguments),
        "\n",
        output,
        (f"\n… {more} more lines" if more else "", "dim"),
    )
    return Panel(body, title=title, title_align="left")
