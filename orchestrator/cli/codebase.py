"""``orchestrator codebase ...``: add, list and remove codebase images."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from orchestrator.cli import audit
from orchestrator.config import get_settings
from orchestrator.images.base import ImageBuildError
from orchestrator.images.catalog import catalog_line
from orchestrator.images.codebases import (
    CodebaseError,
    CodebaseInfo,
    add_codebase,
    list_codebases,
    publish_codebase,
    remove_codebase,
)
from orchestrator.sandbox.backend import BackendUnavailable
from orchestrator.state.audit import AuditEvent

app = typer.Typer(help="Manage codebases (images with a tree at /workspace).", no_args_is_help=True)

_ERRORS = (CodebaseError, ImageBuildError, BackendUnavailable)


def _fail(exc: Exception) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(1)


@app.command("add")
def add(
    name: Annotated[str, typer.Argument(help="Codebase name: [a-z0-9][a-z0-9._-]*, at most 64.")],
    source: Annotated[Path, typer.Argument(help="A directory or a local git repository.")],
    rev: Annotated[
        str | None,
        typer.Option(help="Git revision to export (default HEAD); only its history is kept."),
    ] = None,
    replace: Annotated[bool, typer.Option(help="Replace an existing codebase.")] = False,
) -> None:
    """Build the image of a codebase from a directory or a git revision."""
    try:
        info = add_codebase(get_settings(), name, source, rev, replace=replace, progress=typer.echo)
    except _ERRORS as exc:
        raise _fail(exc) from exc
    commit = f" at {info.commit[:12]}" if info.commit else ""
    typer.echo(f"codebase {info.name}{commit}: {info.image} ({info.image_id[7:19]})")
    audit.record(
        get_settings(),
        AuditEvent.CODEBASE_ADDED,
        codebase=info.name,
        image_id=info.image_id,
        commit=info.commit,
        replaced=replace,
    )


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB"):
        if size < 1000:
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1000
    return f"{size:.1f}GB"


def _table(rows: list[CodebaseInfo]) -> str:
    header = ("NAME", "IMAGE ID", "COMMIT", "SOURCE", "SIZE")
    cells = [
        (
            r.name,
            r.image_id.removeprefix("sha256:")[:12],
            r.commit[:12] or "-",
            r.source,
            _size(r.size_bytes),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *cells]
    )


@app.command("ls")
def ls() -> None:
    """List codebases."""
    try:
        rows = list_codebases(get_settings())
    except _ERRORS as exc:
        raise _fail(exc) from exc
    typer.echo(_table(rows))


@app.command("rm")
def rm(name: Annotated[str, typer.Argument(help="Codebase name.")]) -> None:
    """Remove a codebase's image."""
    try:
        remove_codebase(get_settings(), name)
    except _ERRORS as exc:
        raise _fail(exc) from exc
    typer.echo(f"removed codebase {name}")
    audit.record(get_settings(), AuditEvent.CODEBASE_REMOVED, codebase=name)


@app.command("publish")
def publish(
    name: Annotated[str, typer.Argument(help="Codebase name.")],
    registry: Annotated[
        str | None,
        typer.Option(
            help="Registry prefix, e.g. registry.example.com/team/ (default: "
            "ORCH_K8S_IMAGE_REGISTRY)."
        ),
    ] = None,
) -> None:
    """Push a codebase's image to the registry a cluster pulls from, and print its
    catalogue entry (for ORCH_CODEBASES_FILE, or the Helm chart's `codebases` value)."""
    settings = get_settings()
    target = settings.k8s_image_registry if registry is None else registry
    if not target:
        raise _fail(ValueError("no registry: pass --registry or set ORCH_K8S_IMAGE_REGISTRY"))
    try:
        ref = publish_codebase(settings, name, target)
    except _ERRORS as exc:
        raise _fail(exc) from exc
    typer.echo(catalog_line(name, ref))
    audit.record(settings, AuditEvent.CODEBASE_PUBLISHED, codebase=name, image=ref)
