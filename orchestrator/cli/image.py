"""``orchestrator image ...``: build the sandbox base image (and the OS image under it)."""

from __future__ import annotations

from typing import Annotated

import typer

from orchestrator.config import get_settings
from orchestrator.images.base import ImageBuildError, build_base_image
from orchestrator.sandbox.backend import BackendUnavailable

app = typer.Typer(help="Build sandbox images.", no_args_is_help=True)


@app.command("build")
def build(
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Rebuild even when the inputs are unchanged, without layer cache."
        ),
    ] = False,
) -> None:
    """Build the base sandbox image; skipped when its inputs have not changed."""
    settings = get_settings()
    # The progress lines already end with what happened (built or skipped, and the image id).
    try:
        build_base_image(settings, force=force, progress=typer.echo)
    except (ImageBuildError, BackendUnavailable) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
