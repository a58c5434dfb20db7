"""``orchestrator preflight``: before a job is paid for. With ``--job``, what an Agent RFT
platform's own preflight endpoints do, against the deployed URLs of the job: one call per
tool and one grade on a row of the dataset, checking shape, auth and time
(orchestrator.rft.preflight). With ``--rows``, every row of the dataset checked through
this deployment's rollout API: it starts, its gold files exist at its commit, a SWE-style
row's tests fail before its gold patch and pass after it (orchestrator.client.row_checks). Exit
status 1 when any check fails."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from orchestrator.cli.serve import operator_token
from orchestrator.cli.status import default_api_url
from orchestrator.client import RolloutClient
from orchestrator.client.row_checks import check_rows
from orchestrator.config import get_settings
from orchestrator.rft.job import JobBody
from orchestrator.rft.preflight import run_preflight

console = Console(width=160)


def preflight(
    dataset: Annotated[
        Path,
        typer.Option(exists=True, dir_okay=False, help="The dataset (rft-config --out's rows)."),
    ],
    job: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="The job body (rft-config's output)."),
    ] = None,
    rows: Annotated[
        bool, typer.Option("--rows", help="Check every row of the dataset in sandboxes.")
    ] = False,
    base_url: Annotated[
        str | None, typer.Option(help="With --rows: the API (default: this deployment's).")
    ] = None,
    parallel: Annotated[int, typer.Option(min=1, max=64, help="With --rows: rows at once.")] = 4,
    line: Annotated[int, typer.Option(min=1, help="Which row of the dataset to try.")] = 1,
    arguments: Annotated[
        list[str] | None,
        typer.Option(
            help="TOOL=JSON: a tool's arguments instead of the smallest its schema asks for."
        ),
    ] = None,
    timeout_s: Annotated[float, typer.Option(help="Per request.")] = 600.0,
) -> None:
    """Try each tool and the grader of a job on one of its rows, as the platform will
    (--job); check every row of the dataset in sandboxes (--rows)."""
    if job is None and not rows:
        typer.echo("error: give --job (the platform's checks), --rows, or both", err=True)
        raise typer.Exit(2)
    failed = _row_checks(dataset, base_url, parallel) if rows else False
    if job is not None:
        failed |= _job_checks(job, dataset, line, arguments, timeout_s)
    if failed:
        raise typer.Exit(1)


def _job_checks(
    job: Path, dataset: Path, line: int, arguments: list[str] | None, timeout_s: float
) -> bool:
    try:
        body = JobBody.model_validate_json(job.read_text())
    except ValidationError as exc:
        typer.echo(f"error: {job} is not a job body: {exc.errors()[0]['msg']}", err=True)
        raise typer.Exit(2) from exc
    row = _row(dataset, line)
    overrides: dict[str, dict[str, Any]] = {}
    for given in arguments or []:
        name, _, text = given.partition("=")
        try:
            overrides[name] = json.loads(text)
        except ValueError as exc:
            typer.echo(f"error: --arguments {given!r}: not JSON: {exc}", err=True)
            raise typer.Exit(2) from exc
    checks = run_preflight(body, row, arguments=overrides, timeout_s=timeout_s)
    table = Table(title=f"preflight of {job} on {dataset}:{line}")
    for column in ("check", "result", "ms", "detail"):
        table.add_column(column)
    for check in checks:
        table.add_row(
            check.what,
            "[green]ok[/green]" if check.ok else "[red]FAILED[/red]",
            f"{check.ms:.0f}" if check.ms is not None else "",
            check.detail,
        )
    console.print(table)
    return not all(c.ok for c in checks)


def _row_checks(dataset: Path, base_url: str | None, parallel: int) -> bool:
    settings = get_settings()
    numbered = [
        (number, _row(dataset, number))
        for number, text in enumerate(dataset.read_text(encoding="utf-8").splitlines(), start=1)
        if text.strip()
    ]
    token = operator_token(settings)
    columns = (
        TextColumn("checking rows"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
    )
    with (
        RolloutClient(base_url or default_api_url(settings), token) as client,
        Progress(*columns, console=console, transient=True) as progress,
    ):
        task = progress.add_task("rows", total=len(numbered))
        reports = check_rows(
            client, numbered, parallel=parallel, progress=lambda: progress.advance(task)
        )
    table = Table(title=f"row checks of {dataset}")
    for column in ("line", "check", "result", "detail"):
        table.add_column(column)
    for report in reports:
        for check in report.checks:
            table.add_row(
                str(check.line),
                check.what,
                "[green]ok[/green]" if check.ok else "[red]FAILED[/red]",
                check.detail,
            )
    console.print(table)
    bad = [r.line for r in reports if not r.ok]
    console.print(f"{len(reports)} rows: {len(reports) - len(bad)} ready, {len(bad)} failed")
    return bool(bad)


def _row(dataset: Path, line: int) -> dict[str, Any]:
    lines = dataset.read_text(encoding="utf-8").splitlines()
    if line > len(lines):
        typer.echo(f"error: {dataset} has {len(lines)} lines, not {line}", err=True)
        raise typer.Exit(2)
    try:
        row = json.loads(lines[line - 1])
    except ValueError as exc:
        typer.echo(f"error: {dataset}:{line}: not JSON: {exc}", err=True)
        raise typer.Exit(2) from exc
    if not isinstance(row, dict):
        typer.echo(f"error: {dataset}:{line}: not a JSON object", err=True)
        raise typer.Exit(2)
    return row
