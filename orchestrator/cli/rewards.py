"""``orchestrator export`` and ``orchestrator regrade``: the stored rollouts with their
grades, as files a dataset library reads, and scored again by another environment's grader
(views/rewards.py; docs/graders.md)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from orchestrator.cli.times import when
from orchestrator.config import get_settings
from orchestrator.environments.loader import (
    EnvironmentConfigError,
    UnknownEnvironment,
    load_environments,
)
from orchestrator.grading import GraderConfigError
from orchestrator.outcomes import Outcome
from orchestrator.state.models import TrajectoryStep
from orchestrator.state.records import Rollout, RolloutStore
from orchestrator.views.format import console
from orchestrator.views.rewards import (
    ExportFormat,
    ExportWriter,
    Regraded,
    Regrader,
    RolloutFilter,
    export_row,
    matching_ids,
    stored,
)

Since = Annotated[
    str | None,
    typer.Option(help="Created at or after: an ISO 8601 time, Unix seconds, or an age (2h, 7d)."),
]
Until = Annotated[
    str | None, typer.Option(help="Created before: an ISO 8601 time, Unix seconds, or an age (1h).")
]
Environment = Annotated[str | None, typer.Option(help="Only rollouts of this environment.")]
OutcomeOption = Annotated[Outcome | None, typer.Option(help="Only rollouts with this outcome.")]
TenantOption = Annotated[
    str | None, typer.Option(help="Only this tenant's rollouts (docs/tenancy.md).")
]


def _selection(
    since: str | None,
    until: str | None,
    environment: str | None,
    outcome: Outcome | None,
    *,
    graded: bool,
    tenant: str | None,
) -> RolloutFilter:
    return RolloutFilter(
        since=when(since, "--since"),
        until=when(until, "--until"),
        environment=environment,
        outcome=outcome,
        graded=graded,
        tenant=tenant,
    )


def _walk(
    selection: RolloutFilter,
    description: str,
    visit: Callable[[Rollout, list[TrajectoryStep]], object],
) -> None:
    """``visit`` each stored rollout ``selection`` admits, with its trajectory, under a
    progress bar on standard error (the whole history is read: views/rewards.py)."""
    settings = get_settings()

    async def run() -> None:
        store = RolloutStore.connect(settings, role="cli")
        try:
            ids = await matching_ids(store)
            with Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            ) as progress:
                task = progress.add_task(description, total=len(ids))
                async for rollout, trajectory in stored(
                    store, ids, selection, progress=lambda n: progress.advance(task, n)
                ):
                    visit(rollout, trajectory)
        finally:
            await store.close()

    asyncio.run(run())


def export(
    out: Annotated[Path, typer.Argument(help="The file to write (.jsonl or .parquet).")],
    since: Since = None,
    until: Until = None,
    environment: Environment = None,
    outcome: OutcomeOption = None,
    graded: Annotated[bool, typer.Option(help="Only rollouts with a stored score.")] = False,
    tenant: TenantOption = None,
    form: Annotated[
        ExportFormat | None,
        typer.Option("--format", help="jsonl or parquet; by default, the file's extension."),
    ] = None,
) -> None:
    """Write the deployment's rollouts with their trajectories and grades (the answer,
    the sample, the grader and its configuration's digest, the score and its details) as
    JSONL or Parquet, for datasets.load_dataset. Reads the whole history."""
    if form is None:
        suffix = out.suffix.lower().lstrip(".")
        if suffix not in {f.value for f in ExportFormat}:
            raise typer.BadParameter(
                f"cannot tell the format from {out.name!r}: name a .jsonl or .parquet file, "
                "or give --format",
                param_hint="--format",
            )
        form = ExportFormat(suffix)
    selection = _selection(since, until, environment, outcome, graded=graded, tenant=tenant)
    writer = ExportWriter(out, form)
    try:
        _walk(
            selection, "exporting", lambda rollout, steps: writer.write(export_row(rollout, steps))
        )
    finally:
        writer.close()
    rows = writer.rows
    typer.echo(f"wrote {rows} rollouts to {out} ({form.value})")


def regrade(
    grader_environment: Annotated[
        str,
        typer.Argument(
            help="The environment (in this deployment's environments file) whose grader "
            "scores the stored rollouts."
        ),
    ],
    since: Since = None,
    until: Until = None,
    environment: Annotated[
        str | None, typer.Option(help="Only rollouts of this environment (default: any).")
    ] = None,
    outcome: OutcomeOption = None,
    tenant: TenantOption = None,
    limit: Annotated[int, typer.Option(min=1, help="Show at most this many rows.")] = 50,
    json_: Annotated[bool, typer.Option("--json", help="Print JSON (every rollout).")] = False,
) -> None:
    """Score stored, graded rollouts again with another environment's grader, from their
    stored answers, samples, rows and trajectories: old against new, nothing stored. A
    grader that needs the sandbox cannot run again (the sandbox is gone): its stored
    verdict stands and the row says so."""
    settings = get_settings()
    try:
        regrader = Regrader(load_environments(settings), grader_environment)
    except (EnvironmentConfigError, UnknownEnvironment, GraderConfigError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    entries: list[Regraded] = []
    _walk(
        _selection(since, until, environment, outcome, graded=True, tenant=tenant),
        "regrading",
        lambda rollout, steps: entries.append(regrader.regrade(rollout, steps)),
    )
    report = regrader.report(entries)
    if json_:
        typer.echo(report.model_dump_json(indent=2))
        return
    table = Table(
        title=f"regraded by {grader_environment} ({report.grader}, {report.grader_digest})",
        title_justify="left",
    )
    table.add_column("rollout id", overflow="fold")
    table.add_column("environment")
    table.add_column("old", justify="right")
    table.add_column("new", justify="right")
    table.add_column("note", overflow="fold")
    for entry in report.rollouts[:limit]:
        table.add_row(
            entry.rollout_id,
            entry.environment,
            _score(entry.old_score),
            _score(entry.new_score),
            entry.error
            or entry.skipped
            or ("changed" if entry.old_score != entry.new_score else ""),
        )
    out = console()
    out.print(table)
    out.print(
        f"{report.regraded} regraded, {report.changed} changed, {report.skipped} skipped, "
        f"{report.errors} failed; mean {_score(report.old_mean)} -> {_score(report.new_mean)}"
    )


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
