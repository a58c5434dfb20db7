"""``orchestrator preflight``: before an Agent RFT job is paid for, what the platform's own
preflight endpoints do, against the deployed URLs of the job: one call per tool and one
grade on a row of the dataset, checking shape, auth and time (orchestrator.rft.preflight).
Exit status 1 when any check fails."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from orchestrator.rft.job import JobBody
from orchestrator.rft.preflight import run_preflight

console = Console(width=160)


def preflight(
    job: Annotated[
        Path,
        typer.Option(exists=True, dir_okay=False, help="The job body (rft-config's output)."),
    ],
    dataset: Annotated[
        Path,
        typer.Option(exists=True, dir_okay=False, help="The dataset (rft-config --out's rows)."),
    ],
    line: Annotated[int, typer.Option(min=1, help="Which row of the dataset to try.")] = 1,
    arguments: Annotated[
        list[str] | None,
        typer.Option(
            help="TOOL=JSON: a tool's arguments instead of the smallest its schema asks for."
        ),
    ] = None,
    timeout_s: Annotated[float, typer.Option(help="Per request.")] = 600.0,
) -> None:
    """Try each tool and the grader of a job on one of its rows, as the platform will."""
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
    if not all(c.ok for c in checks):
        raise typer.Exit(1)


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
